"""HTTP semantics of control routes, in process: the control plane answers from memory
(:mod:`tests.unit.gateway.memory_control_plane`), no Redis, no worker."""

from __future__ import annotations

import httpx
import orjson
import pytest

from sluice.core.routing import Routing
from sluice.core.settings import GatewaySettings
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


async def test_a_routing_change_keeps_the_shadow_a_rollout_set(
    client: httpx.AsyncClient, control: MemoryControlPlane
) -> None:
    """A rollout's shadow phase mirrors requests through the routing hash; an administrator
    who changes labels or weights meanwhile changes those alone."""
    control.routings[MODEL] = Routing({}, {1: 100}, {2: 100})
    async with client:
        labels = await client.put(ROUTING, json={"labels": {"stable": 1}})
        weights = await client.put(ROUTING, json={"weights": {"1": 10}})
        label = await client.put(f"{ROUTING}/labels/prod", json={"version": 1})
        removed = await client.delete(f"{ROUTING}/labels/prod")
    for answer in (labels, weights, label, removed):
        assert answer.status_code == 200, answer.text
        assert answer.json()["shadow"] == {"2": 100}
    assert control.routings[MODEL] == Routing({"stable": 1}, {1: 10}, {2: 100})


async def test_a_bad_rollout_request_is_refused_at_once_naming_the_field(
    control: MemoryControlPlane,
) -> None:
    """Checked by the gateway: told at once (no controller answers here), and never handed
    on to be carried out when a controller comes."""
    config = identity_config(MODEL, ["FP32"], [-1], 8)
    settings = GatewaySettings(model_control_timeout_s=1)
    app = in_process_gateway(MODEL, config, EchoDispatcher(["OUT_FP32"]), settings, control)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
        for body, field in (
            ({"version": 2, "step_s": 0}, "'step_s'"),
            ({"version": 2, "max_error_increase": -1}, "'max_error_increase'"),
            ({"version": 2, "steps": [0, 200]}, "'steps'"),
            ({"version": 2, "stpes": [10]}, "'stpes'"),
            ({"version": "2"}, "'version'"),
            ({"version": 1 << 70}, "'version'"),
        ):
            answer = await client.post(ROLLOUT, json=body)
            assert answer.status_code == 400, (body, answer.text)
            assert field in answer.json()["error"]
    assert control.commands == []


async def test_a_rollout_no_controller_took_up_is_taken_back(
    control: MemoryControlPlane,
) -> None:
    """Told 503 (no controller leads), the client must not see its rollout start later,
    when one does: the command leaves the controller's stream."""
    config = identity_config(MODEL, ["FP32"], [-1], 8)
    settings = GatewaySettings(model_control_timeout_s=0.2)
    app = in_process_gateway(MODEL, config, EchoDispatcher(["OUT_FP32"]), settings, control)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
        answer = await client.post(ROLLOUT, json={"version": 2})
    assert answer.status_code == 503, answer.text
    assert len(control.commands) == 1 and control.dropped == ["1-0"]


@pytest.mark.parametrize("phase", ["loading", "shadow", "canary", "promoting"])
async def test_the_split_is_the_rollouts_while_one_is_under_way(
    client: httpx.AsyncClient, control: MemoryControlPlane, phase: str
) -> None:
    """Removed while the candidate loads, the split would send the candidate every request
    before it is judged (it is the highest ready version)."""
    control.routings[MODEL] = Routing({}, {1: 100})
    control.rollouts[MODEL] = orjson.dumps({"model": MODEL, "phase": phase})
    async with client:
        weights = await client.put(ROUTING, json={"weights": {"1": 10}})
        deleted = await client.delete(ROUTING)
        labels = await client.put(ROUTING, json={"labels": {"stable": 1}})
        control.rollouts[MODEL] = orjson.dumps({"model": MODEL, "phase": "rolled_back"})
        after = await client.put(ROUTING, json={"weights": {}})
    for answer in (weights, deleted):
        assert answer.status_code == 409, answer.text
        assert "rollout under way" in answer.json()["error"]
    assert labels.status_code == 200, labels.text
    assert after.status_code == 200, after.text
    assert control.routings[MODEL] == Routing({"stable": 1}, {})
