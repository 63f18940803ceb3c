"""TorchServe's versions named on its routes, in process: by their exact text, as TorchServe
keys them (``2`` and ``2.0`` are two versions, and ``2`` does not find ``2.0``), with
TorchServe's 404s, set-default's in its own words."""

from __future__ import annotations

import dataclasses

import httpx
import pytest

from sluice.core.catalog import CatalogEntry
from sluice.core.config import parse_config_text
from sluice.core.torchserve.versions import VersionRecord
from sluice.gateway.http.fast_path import InferFastPath
from sluice.gateway.torchserve.management import router as management
from sluice.gateway.torchserve.routes import router as inference
from tests.support.onnx_models import identity_config
from tests.unit.gateway.in_process import EchoDispatcher, in_process_gateway
from tests.unit.gateway.memory_control_plane import MemoryControlPlane


def _gateway(versions: dict[int, str]) -> InferFastPath:
    """Model ``m`` serving ``versions`` (number -> TorchServe's version)."""
    app = in_process_gateway(
        "alone",
        identity_config("alone", ["FP32"], [-1], 8),
        EchoDispatcher(["OUT_FP32"]),
        control=MemoryControlPlane(explicit=True),
    )
    app.app.include_router(management)
    app.app.include_router(inference)
    config = parse_config_text(identity_config("m", ["FP32"], [-1], 8), model_name="m")
    parameters = {
        key: value
        for number, version in versions.items()
        for key, value in VersionRecord(version, f"m-{version}.mar").parameters(number).items()
    }
    config = dataclasses.replace(config, parameters=parameters)
    view = app.app.state.sluice.view
    view.models["m"] = CatalogEntry("m", tuple(sorted(versions)), config)
    view.ready["m"] = frozenset(versions)
    return app


def _client(app: InferFastPath) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://ts")


def _missing(version: str) -> dict[str, object]:
    return {
        "code": 404,
        "type": "ModelVersionNotFoundException",
        "message": f"Model version: {version} does not exist for model: m",
    }


async def test_a_version_of_the_same_value_is_not_the_version_served() -> None:
    async with _client(_gateway({2: "2.0"})) as client:
        answers = [
            await client.get("/models/m/2"),
            await client.put("/models/m/2?min_worker=1"),
            await client.delete("/models/m/2"),
            await client.post("/predictions/m/2", content=b"x"),
            await client.post("/explanations/m/2.00", content=b"x"),
        ]
        described = await client.get("/models/m/2.0")
    for answer in answers:
        version = answer.request.url.path.rsplit("/", 1)[-1]
        assert (answer.status_code, answer.json()) == (404, _missing(version)), answer.request.url
    assert described.status_code == 200
    assert [row["modelVersion"] for row in described.json()] == ["2.0"]


async def test_two_versions_of_one_value_are_two_versions() -> None:
    async with _client(_gateway({2: "2.0", 3: "2"})) as client:
        whole = await client.get("/models/m/2")
        decimal = await client.get("/models/m/2.0")
        every = await client.get("/models/m/all")
    assert [(row["modelVersion"], row["modelUrl"]) for row in whole.json()] == [("2", "m-2.mar")]
    assert [(row["modelVersion"], row["modelUrl"]) for row in decimal.json()] == [
        ("2.0", "m-2.0.mar")
    ]
    assert [row["modelVersion"] for row in every.json()] == ["2.0", "2"]


@pytest.mark.parametrize(
    ("path", "kind", "message"),
    [
        (
            "/models/m/2/set-default",
            "ModelVersionNotFoundException",
            "Model version 2 does not exist for model m",
        ),
        (
            "/models/m/abc/set-default",
            "ModelVersionNotFoundException",
            "Model version abc does not exist for model m",
        ),
        ("/models/nope/2.0/set-default", "ModelNotFoundException", "Model not found: nope"),
    ],
)
async def test_set_default_answers_in_torchserve_s_words(
    path: str, kind: str, message: str
) -> None:
    """TorchServe's set-default names a missing version without the colons its other
    routes' 404 has (``ModelVersionedRefs``), and a missing model as they do."""
    async with _client(_gateway({2: "2.0"})) as client:
        answer = await client.put(path)
    assert answer.status_code == 404
    assert answer.json() == {"code": 404, "type": kind, "message": message}
