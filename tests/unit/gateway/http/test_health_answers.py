"""Triton's answers to the health and readiness routes, in process: a status and no body
(``content-length: 0``) for live and ready, for a server not ready too; Triton's error
document for a model version not ready."""

from __future__ import annotations

import httpx
import pytest

from sluice.gateway.http.fast_path import InferFastPath
from sluice.gateway.state import GatewayState
from tests.support.onnx_models import identity_config
from tests.unit.gateway.in_process import EchoDispatcher, in_process_gateway

MODEL = "echo"


@pytest.fixture
def gateway() -> InferFastPath:
    return in_process_gateway(
        MODEL, identity_config(MODEL, ["FP32"], [-1], 8), EchoDispatcher(["OUT_FP32"])
    )


def _state(gateway: InferFastPath) -> GatewayState:
    state: GatewayState = gateway.app.state.sluice
    return state


async def _get(gateway: InferFastPath, path: str) -> httpx.Response:
    transport = httpx.ASGITransport(app=gateway)
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
        return await client.get(path)


def _empty(response: httpx.Response, status: int) -> None:
    assert response.status_code == status, response.text
    assert response.content == b""
    assert response.headers["content-length"] == "0"
    assert "content-type" not in response.headers


@pytest.mark.parametrize(
    "path",
    [
        "/v2/health/live",
        "/v2/health/ready",
        f"/v2/models/{MODEL}/ready",
        f"/v2/models/{MODEL}/versions/1/ready",
    ],
)
async def test_live_and_ready_are_a_200_with_no_body(gateway: InferFastPath, path: str) -> None:
    _empty(await _get(gateway, path), 200)


async def test_a_server_not_ready_is_a_400_with_no_body(gateway: InferFastPath) -> None:
    _state(gateway).redis_ok = False
    _empty(await _get(gateway, "/v2/health/ready"), 400)
    _empty(await _get(gateway, "/v2/health/live"), 200)


async def test_a_model_not_ready_is_a_400_with_the_error_document(gateway: InferFastPath) -> None:
    _state(gateway).view.ready = {}
    for path in (f"/v2/models/{MODEL}/ready", f"/v2/models/{MODEL}/versions/1/ready"):
        response = await _get(gateway, path)
        assert response.status_code == 400
        assert response.json() == {
            "error": f"Model version not ready; model '{MODEL}' version 1 has no live worker yet"
        }
