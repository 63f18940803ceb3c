"""What the gateway answers about a name several repositories hold (model namespacing,
Triton's --model-namespacing=true), in process: every request naming it is refused with
Triton's words, it is not ready, the repository index and the statistics list each copy
under it, TorchServe's management API lists it once, and a copy's internal name is unknown
to clients, answered as any unknown name is while namespacing is on: Triton's 400. Triton's
other texts name a model by its repository too, and a model not loaded is unknown until it
was loaded once, then missing from Triton's map of namespaces."""

from __future__ import annotations

from dataclasses import replace

import httpx
import pytest

from sluice.core.catalog import UNLOADED, CatalogEntry
from sluice.gateway.http.fast_path import InferFastPath
from sluice.gateway.torchserve.management import router as management
from tests.support.onnx_models import identity_config
from tests.unit.gateway.in_process import EchoDispatcher, in_process_gateway
from tests.unit.gateway.memory_control_plane import MemoryControlPlane
from tests.unit.gateway.name_held_twice import AMBIGUOUS, hold_comp_twice

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
    hold_comp_twice(app)
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


def _in_repository(gateway: InferFastPath) -> None:
    """``alone`` from ``/models/a``, as the catalog of a view joining repositories says."""
    view = gateway.app.state.sluice.view
    view.models["alone"] = replace(view.models["alone"], namespace="/models/a")


async def test_a_known_models_missing_version_is_named_by_its_repository_too(
    gateway: InferFastPath, client: httpx.AsyncClient
) -> None:
    """Triton's texts name a model ``<namespace>::<name>`` once it has found its identifier
    (core ``ModelLifeCycle::GetModel``): with namespacing, by its repository."""
    _in_repository(gateway)
    async with client:
        answers = [
            await client.post("/v2/models/alone/versions/9/infer", json=BODY),
            await client.get("/v2/models/alone/versions/9"),
            await client.get("/v2/models/alone/versions/9/config"),
        ]
    for answer in answers:
        assert (answer.status_code, answer.json()) == (
            404,
            {"error": "Request for unknown model: '/models/a::alone' version 9 is not found"},
        ), answer.url


async def test_with_one_repository_a_missing_version_is_named_by_it(
    gateway: InferFastPath, client: httpx.AsyncClient
) -> None:
    gateway.app.state.sluice.view.sole_repository = "models"
    async with client:
        answer = await client.post("/v2/models/alone/versions/9/infer", json=BODY)
    assert answer.json() == {
        "error": "Request for unknown model: 'models::alone' version 9 is not found"
    }


async def test_without_namespacing_a_missing_version_is_named_by_the_name_alone(
    gateway: InferFastPath, client: httpx.AsyncClient
) -> None:
    _in_repository(gateway)
    gateway.app.state.sluice.view.namespacing = False
    async with client:
        answer = await client.post("/v2/models/alone/versions/9/infer", json=BODY)
    assert (answer.status_code, answer.json()) == (
        404,
        {"error": "Request for unknown model: 'alone' version 9 is not found"},
    )


def _unloaded(gateway: InferFastPath, *, once_loaded: bool) -> None:
    """``idle``: a model of the repository not loaded (explicit model control)."""
    gateway.app.state.sluice.view.models["idle"] = CatalogEntry(
        "idle", (), None, UNLOADED, namespace="/models/a", once_loaded=once_loaded
    )


async def test_a_model_never_loaded_is_unknown_as_in_triton(
    gateway: InferFastPath, client: httpx.AsyncClient
) -> None:
    """Triton's map of namespaces holds no name it has not loaded: INVALID_ARG, as for a
    name no repository holds. Readiness: not ready."""
    _unloaded(gateway, once_loaded=False)
    async with client:
        answers = await _asked_of(client, "idle")
        ready = await client.get("/v2/models/idle/ready")
    for answer in answers:
        assert (answer.status_code, answer.json()) == (400, _unknown("idle")), answer.url
    assert (ready.status_code, ready.json()) == (
        400,
        {"error": "Model version not ready; Request for unknown model: 'idle' is not found"},
    )


async def test_a_model_unloaded_after_a_load_is_not_in_the_global_map(
    gateway: InferFastPath, client: httpx.AsyncClient
) -> None:
    """Once loaded, Triton keeps the name in its map, with no model after the unload."""
    _unloaded(gateway, once_loaded=True)
    missing = {"error": "Identifier of model 'idle' is not found in global map"}
    async with client:
        answers = await _asked_of(client, "idle")
        ready = await client.get("/v2/models/idle/ready")
    for answer in answers:
        assert (answer.status_code, answer.json()) == (404, missing), answer.url
    assert ready.status_code == 400
    assert ready.json() == {"error": f"Model version not ready; {missing['error']}"}


async def test_without_namespacing_a_model_not_loaded_is_unavailable(
    gateway: InferFastPath, client: httpx.AsyncClient
) -> None:
    _unloaded(gateway, once_loaded=True)
    gateway.app.state.sluice.view.namespacing = False
    async with client:
        answer = await client.post("/v2/models/idle/infer", json=BODY)
        metadata = await client.get("/v2/models/idle")
    assert answer.status_code == 503
    assert answer.json()["error"].startswith(
        "Request for unknown model: 'idle' has no available versions"
    )
    assert metadata.status_code == 503


@pytest.mark.parametrize("namespacing", [True, False])
async def test_the_index_lists_a_model_never_loaded_by_its_name_alone(
    gateway: InferFastPath, client: httpx.AsyncClient, namespacing: bool
) -> None:
    """As Triton's index: a model of the repository it never loaded has a name and no state;
    one unloaded after a load is UNAVAILABLE, "unloaded"."""
    gateway.app.state.sluice.view.namespacing = namespacing
    _unloaded(gateway, once_loaded=False)
    async with client:
        never = (await client.post("/v2/repository/index", json={})).json()
        ready_only = (await client.post("/v2/repository/index", json={"ready": True})).json()
        _unloaded(gateway, once_loaded=True)
        unloaded = (await client.post("/v2/repository/index", json={})).json()
    assert {"name": "idle"} in never
    assert all(row["name"] != "idle" for row in ready_only)
    assert {"name": "idle", "state": "UNAVAILABLE", "reason": UNLOADED} in unloaded
