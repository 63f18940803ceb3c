"""What the gateway answers about a name several repositories hold (model namespacing,
Triton's --model-namespacing=true), in process: every request naming it is refused with
Triton's words, it is not ready, the repository index and the statistics list each copy
under it, TorchServe's management API lists it once, and a copy's internal name is unknown
to clients, answered as any unknown name is while namespacing is on: Triton's 400."""

from __future__ import annotations

import httpx
import pytest

from sluice.core.catalog import UNLOADED, CatalogEntry
from sluice.core.config import parse_config_text
from sluice.core.repository_namespaces import ambiguity
from sluice.gateway.http.fast_path import InferFastPath
from sluice.gateway.torchserve.management import router as management
from tests.support.onnx_models import identity_config
from tests.unit.gateway.in_process import EchoDispatcher, in_process_gateway
from tests.unit.gateway.memory_control_plane import MemoryControlPlane

AMBIGUOUS = (
    "There are 2 identifiers of model 'comp' in global map, model namespace must be provided "
    "to resolve ambiguity."
)
BODY = {"inputs": [{"name": "IN_FP32", "shape": [1, 1], "datatype": "FP32", "data": [1]}]}


@pytest.fixture
def control() -> MemoryControlPlane:
    return MemoryControlPlane()


@pytest.fixture
def gateway(control: MemoryControlPlane) -> InferFastPath:
    """``alone`` served as itself; ``comp`` held by two repositories: its copies ``comp@1``
    and ``comp@2`` served (ready), ``comp`` itself ambiguous. TorchServe's management API
    beside Triton's."""
    app = in_process_gateway(
        "alone",
        identity_config("alone", ["FP32"], [-1], 8),
        EchoDispatcher(["OUT_FP32"]),
        control=control,
    )
    app.app.include_router(management)
    view = app.app.state.sluice.view
    view.namespacing = True
    for copy in ("comp@1", "comp@2"):
        config = parse_config_text(identity_config(copy, ["FP32"], [-1], 8), model_name=copy)
        view.models[copy] = CatalogEntry(copy, (1,), config, listed_as="comp")
        view.ready[copy] = frozenset((1,))
    view.models["comp"] = CatalogEntry("comp", (), None, ambiguity("comp", 2), ambiguous=True)
    return app


@pytest.fixture
def client(gateway: InferFastPath) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=gateway), base_url="http://gateway")


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
    assert internal.status_code == 400
    assert internal.json() == {"error": "Request for unknown model: 'comp@1' is not found"}
    listed = [
        (row["name"], row["inference_stats"]["success"]["count"])
        for row in stats.json()["model_stats"]
    ]
    assert listed == [("alone", 0), ("comp", 0), ("comp", 3)]
    assert ready.status_code == 200


def _unknown(model: str) -> dict[str, str]:
    return {"error": f"Request for unknown model: '{model}' is not found"}


async def _asked_of(client: httpx.AsyncClient, model: str) -> list[httpx.Response]:
    """Inference (by version too), metadata, configuration and statistics of ``model``."""
    return [
        await client.post(f"/v2/models/{model}/infer", json=BODY),
        await client.post(f"/v2/models/{model}/versions/1/infer", json=BODY),
        await client.get(f"/v2/models/{model}"),
        await client.get(f"/v2/models/{model}/config"),
        await client.get(f"/v2/models/{model}/stats"),
    ]


async def test_an_unknown_name_is_tritons_400_while_namespacing_is_on(
    client: httpx.AsyncClient,
) -> None:
    """Triton looks the name up in its namespaces' map first: INVALID_ARG for a name it
    does not find, with the words it uses otherwise. Readiness drops the lookup's error:
    it answers as without namespacing."""
    async with client:
        answers = await _asked_of(client, "nope")
        ready = await client.get("/v2/models/nope/ready")
    for answer in answers:
        assert (answer.status_code, answer.json()) == (400, _unknown("nope")), answer.url
    assert (ready.status_code, ready.json()) == (404, _unknown("nope"))


async def test_without_namespacing_an_unknown_name_is_404() -> None:
    app = in_process_gateway(
        "alone", identity_config("alone", ["FP32"], [-1], 8), EchoDispatcher(["OUT_FP32"])
    )
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
        answers = [*await _asked_of(client, "nope"), await client.get("/v2/models/nope/ready")]
    for answer in answers:
        assert (answer.status_code, answer.json()) == (404, _unknown("nope")), answer.url


async def test_torchserve_lists_a_name_held_twice_once_and_cannot_describe_it(
    client: httpx.AsyncClient,
) -> None:
    async with client:
        listed = await client.get("/models")
        ambiguous = await client.get("/models/comp")
        internal = await client.get("/models/comp@1")
        alone = await client.get("/models/alone")
    assert listed.json() == {
        "models": [
            {"modelName": "alone", "modelUrl": "alone.mar"},
            {"modelName": "comp", "modelUrl": "comp.mar"},
        ]
    }
    assert ambiguous.status_code == 400
    assert ambiguous.json() == {"code": 400, "type": "BadRequestException", "message": AMBIGUOUS}
    assert internal.status_code == 404
    assert internal.json() == {
        "code": 404,
        "type": "ModelNotFoundException",
        "message": "Model not found: comp@1",
    }
    assert alone.status_code == 200
    assert [row["modelName"] for row in alone.json()] == ["alone"]


async def test_torchserve_knows_no_name_none_of_whose_copies_is_loaded(
    gateway: InferFastPath, client: httpx.AsyncClient
) -> None:
    """Explicit model control: the copies are in the catalog, unloaded."""
    view = gateway.app.state.sluice.view
    for copy in ("comp@1", "comp@2"):
        view.models[copy] = CatalogEntry(copy, (), None, UNLOADED, listed_as="comp")
    async with client:
        listed = await client.get("/models")
        described = await client.get("/models/comp")
    assert [row["modelName"] for row in listed.json()["models"]] == ["alone"]
    assert described.status_code == 404
    assert described.json()["message"] == "Model not found: comp"
