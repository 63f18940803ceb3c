"""HTTP semantics of control routes, in process: the control plane answers from memory
(:mod:`tests.unit.gateway.memory_control_plane`), no Redis, no worker."""

from __future__ import annotations

import httpx
import pytest

from sluice.core.routing import Routing
from tests.support.onnx_models import identity_config
from tests.unit.gateway.in_process import EchoDispatcher, in_process_gateway
from tests.unit.gateway.memory_control_plane import MemoryControlPlane

MODEL = "echo"
ROLLOUT = f"/v2/repository/models/{MODEL}/rollout"
ROUTING = f"/v2/repository/models/{MODEL}/routing"


@pytest.fixture
def control() -> MemoryControlPlane:
    return MemoryControlPlane()


@pytest.fixture
def client(control: MemoryControlPlane) -> httpx.AsyncClient:
    config = identity_config(MODEL, ["FP32"], [-1], 8)
    app = in_process_gateway(MODEL, config, EchoDispatcher(["OUT_FP32"]), control=control)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway")


async def test_a_rollout_is_a_404_until_the_control_plane_holds_one(
    client: httpx.AsyncClient, control: MemoryControlPlane
) -> None:
    async with client:
        missing = await client.get(ROLLOUT)
        control.rollouts[MODEL] = b'{"state": "RUNNING"}'
        found = await client.get(ROLLOUT)
    assert missing.status_code == 404
    assert missing.json() == {"error": f"no rollout of model '{MODEL}'"}
    assert found.status_code == 200
    assert found.headers["content-type"] == "application/json"
    assert found.json() == {"state": "RUNNING"}


async def test_a_label_is_written_to_the_control_plane_and_read_back(
    client: httpx.AsyncClient, control: MemoryControlPlane
) -> None:
    async with client:
        put = await client.put(f"{ROUTING}/labels/stable", json={"version": 1})
        unserved = await client.put(f"{ROUTING}/labels/canary", json={"version": 7})
        got = await client.get(ROUTING)
    assert put.status_code == 200, put.text
    assert control.routings[MODEL] == Routing({"stable": 1}, control.routings[MODEL].weights)
    assert unserved.status_code == 400
    assert got.status_code == 200
    assert got.json() == put.json()


async def test_statistics_are_read_through_the_control_plane(
    client: httpx.AsyncClient, control: MemoryControlPlane
) -> None:
    control.statistics[(MODEL, 1)] = {b"success.count": b"3"}
    async with client:
        response = await client.get(f"/v2/models/{MODEL}/stats")
    assert response.status_code == 200, response.text
    [stats] = response.json()["model_stats"]
    assert stats["name"] == MODEL and stats["version"] == "1"
    assert stats["inference_stats"]["success"]["count"] == 3
