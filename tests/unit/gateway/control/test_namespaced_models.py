"""What the gateway answers about a name several repositories hold (model namespacing,
Triton's --model-namespacing=true), in process: every request naming it is refused with
Triton's words, it is not ready, the repository index and the statistics list each copy
under it, and a copy's internal name is unknown to clients."""

from __future__ import annotations

import httpx
import pytest

from sluice.core.catalog import CatalogEntry
from sluice.core.config import parse_config_text
from sluice.core.repository_namespaces import ambiguity
from tests.support.onnx_models import identity_config
from tests.unit.gateway.in_process import EchoDispatcher, in_process_gateway
from tests.unit.gateway.memory_control_plane import MemoryControlPlane

AMBIGUOUS = (
    "There are 2 identifiers of model 'comp' in global map, model namespace must be provided "
    "to resolve ambiguity."
)


@pytest.fixture
def control() -> MemoryControlPlane:
    return MemoryControlPlane()


@pytest.fixture
def client(control: MemoryControlPlane) -> httpx.AsyncClient:
    """``alone`` served as itself; ``comp`` held by two repositories: its copies ``comp@1``
    and ``comp@2`` served (ready), ``comp`` itself ambiguous."""
    app = in_process_gateway(
        "alone",
        identity_config("alone", ["FP32"], [-1], 8),
        EchoDispatcher(["OUT_FP32"]),
        control=control,
    )
    view = app.app.state.sluice.view
    for copy in ("comp@1", "comp@2"):
        config = parse_config_text(identity_config(copy, ["FP32"], [-1], 8), model_name=copy)
        view.models[copy] = CatalogEntry(copy, (1,), config, listed_as="comp")
        view.ready[copy] = frozenset((1,))
    view.models["comp"] = CatalogEntry("comp", (), None, ambiguity("comp", 2), ambiguous=True)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway")


async def test_a_name_held_twice_is_refused_with_tritons_words(client: httpx.AsyncClient) -> None:
    body = {"inputs": [{"name": "IN_FP32", "shape": [1, 1], "datatype": "FP32", "data": [1]}]}
    async with client:
        answers = [
            await client.post("/v2/models/comp/infer", json=body),
            await client.post("/v2/models/comp/versions/1/infer", json=body),
            await client.get("/v2/models/comp"),
            await client.get("/v2/models/comp/config"),
            await client.get("/v2/models/comp/stats"),
        ]
        ready = await client.get("/v2/models/comp/ready")
        served = await client.post("/v2/models/alone/infer", json=body)
    for answer in answers:
        assert (answer.status_code, answer.json()) == (400, {"error": AMBIGUOUS}), answer.url
    assert ready.status_code == 400
    assert ready.json() == {"error": f"Model version not ready; {AMBIGUOUS}"}
    assert served.status_code == 200, served.text


async def test_a_copy_is_listed_under_the_name_and_unknown_by_its_own(
    client: httpx.AsyncClient, control: MemoryControlPlane
) -> None:
    control.statistics[("comp@2", 1)] = {b"success.count": b"3"}
    async with client:
        index = await client.post("/v2/repository/index", json={})
        internal = await client.get("/v2/models/comp@1")
        stats = await client.get("/v2/models/stats")
        ready = await client.get("/v2/health/ready")
    assert index.status_code == 200
    assert index.json() == [
        {"name": "alone", "version": "1", "state": "READY", "reason": ""},
        {"name": "comp", "version": "1", "state": "READY", "reason": ""},
        {"name": "comp", "version": "1", "state": "READY", "reason": ""},
    ]
    assert internal.status_code == 404
    assert internal.json() == {"error": "Request for unknown model: 'comp@1' is not found"}
    listed = [
        (row["name"], row["inference_stats"]["success"]["count"])
        for row in stats.json()["model_stats"]
    ]
    assert listed == [("alone", 0), ("comp", 0), ("comp", 3)]
    assert ready.status_code == 200
