"""HTTP semantics of the inference route, in process: no Redis, no worker (the dispatcher
answers itself, see :mod:`tests.unit.gateway.in_process`)."""

from __future__ import annotations

import httpx
import pytest

from tests.support.onnx_models import identity_config
from tests.unit.gateway.in_process import EchoDispatcher, in_process_gateway

MODEL = "echo"


@pytest.fixture
def dispatcher() -> EchoDispatcher:
    return EchoDispatcher(["OUT_FP32"])


@pytest.fixture
def client(dispatcher: EchoDispatcher) -> httpx.AsyncClient:
    app = in_process_gateway(MODEL, identity_config(MODEL, ["FP32"], [-1], 8), dispatcher)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway")


async def test_a_json_request_gets_its_answer_and_its_request_id(
    client: httpx.AsyncClient, dispatcher: EchoDispatcher
) -> None:
    body = {"inputs": [{"name": "IN_FP32", "datatype": "FP32", "shape": [1, 2], "data": [1.5, 2]}]}
    async with client:
        response = await client.post(
            f"/v2/models/{MODEL}/infer", json=body, headers={"X-Request-ID": "abc"}
        )
    assert response.status_code == 200, response.text
    assert response.headers["x-request-id"] == "abc"
    assert response.headers["content-type"] == "application/json"
    document = response.json()
    assert document["model_name"] == MODEL and document["model_version"] == "1"
    [output] = document["outputs"]
    assert output["name"] == "OUT_FP32" and output["data"] == [1.5, 2.0]
    [message] = dispatcher.submitted
    assert message.request_id == "abc"


async def test_an_unknown_input_is_a_400_with_the_error_document(
    client: httpx.AsyncClient, dispatcher: EchoDispatcher
) -> None:
    body = {"inputs": [{"name": "nope", "datatype": "FP32", "shape": [1, 1], "data": [1]}]}
    async with client:
        response = await client.post(f"/v2/models/{MODEL}/infer", json=body)
    assert response.status_code == 400
    assert "unexpected inference input 'nope'" in response.json()["error"]
    assert response.headers["x-request-id"]
    assert dispatcher.submitted == []


async def test_another_method_on_the_inference_route_is_a_405(client: httpx.AsyncClient) -> None:
    async with client:
        response = await client.get(f"/v2/models/{MODEL}/infer")
    assert response.status_code == 405
    assert response.headers["allow"] == "POST"
    assert response.json() == {"error": "Method Not Allowed"}
