"""TorchServe's management port with model namespacing (Triton's --model-namespacing=true),
in process: a name several repositories hold names no one model, so registering, scaling,
unregistering it and setting its default version are refused as describing it is (400,
Triton's words), and a copy's internal name is unknown (TorchServe's 404)."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import httpx
import pytest

from sluice.core.catalog import UNLOADED, CatalogEntry
from sluice.core.settings import GatewaySettings
from sluice.core.torchserve.archives import MANIFEST
from sluice.gateway.torchserve.management import router as management
from sluice.gateway.torchserve.ports import TorchServePort, management_path
from tests.support.onnx_models import identity_config
from tests.unit.gateway.in_process import EchoDispatcher, in_process_gateway
from tests.unit.gateway.memory_control_plane import MemoryControlPlane
from tests.unit.gateway.name_held_twice import AMBIGUOUS, hold_comp_twice

REQUESTS = (
    ("GET", "/models/comp"),
    ("PUT", "/models/comp?min_worker=2"),
    ("PUT", "/models/comp/1.0?min_worker=2"),
    ("DELETE", "/models/comp"),
    ("DELETE", "/models/comp/1.0"),
    ("PUT", "/models/comp/1.0/set-default"),
)
"""Each route of the management API that names one model."""


@pytest.fixture
def control() -> MemoryControlPlane:
    return MemoryControlPlane(explicit=True)


@pytest.fixture
def port(control: MemoryControlPlane, tmp_path: Path) -> TorchServePort:
    """``comp`` held by two repositories (its copies ``comp@1`` and ``comp@2`` served),
    behind the management port's filter; the model store holds an archive of ``comp``."""
    manifest = {"model": {"modelName": "comp", "handler": "h.py", "modelVersion": "2.0"}}
    with zipfile.ZipFile(tmp_path / "comp.mar", "w") as archive:
        archive.writestr(MANIFEST, json.dumps(manifest))
        archive.writestr("h.py", "def handle(data, context):\n    return data\n")
    app = in_process_gateway(
        "alone",
        identity_config("alone", ["FP32"], [-1], 8),
        EchoDispatcher(["OUT_FP32"]),
        GatewaySettings(model_store=tmp_path),
        control=control,
    )
    app.app.include_router(management)
    hold_comp_twice(app)
    return TorchServePort(app, app.app, management_path)


def _client(port: TorchServePort) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=port), base_url="http://ts")


async def test_a_name_held_twice_is_refused_by_every_route_naming_it(
    port: TorchServePort, control: MemoryControlPlane
) -> None:
    async with _client(port) as client:
        answers = [await client.request(method, path) for method, path in REQUESTS]
    for answer in answers:
        assert answer.status_code == 400, (answer.request.url, answer.text)
        assert answer.json() == {"code": 400, "type": "BadRequestException", "message": AMBIGUOUS}
    assert control.commands == []  # (nothing loaded, unloaded or scaled)


@pytest.mark.parametrize("registered", [True, False])
@pytest.mark.parametrize("query", ["url=comp.mar", "url=comp.mar&model_name=comp"])
async def test_a_name_held_twice_is_not_registered(
    port: TorchServePort, control: MemoryControlPlane, registered: bool, query: str
) -> None:
    """Registering the name (the archive's, or ``model_name``) would lay the archive into
    each repository's copy: refused as every other route naming it is, and so while no copy
    is registered (where those answer 404: there is nothing to register as new either)."""
    if not registered:
        view = port.routes.state.sluice.view
        for copy in ("comp@1", "comp@2"):
            view.models[copy] = CatalogEntry(copy, (), None, UNLOADED, listed_as="comp")
    async with _client(port) as client:
        answer = await client.post(f"/models?{query}")
    assert answer.status_code == 400, answer.text
    assert answer.json() == {"code": 400, "type": "BadRequestException", "message": AMBIGUOUS}
    assert control.commands == []


async def test_a_copy_s_own_name_is_not_found(port: TorchServePort) -> None:
    async with _client(port) as client:
        answers = [
            await client.request(method, path.replace("comp", "comp@1"))
            for method, path in REQUESTS
        ]
    for answer in answers:
        assert answer.status_code == 404, (answer.request.url, answer.text)
        assert answer.json() == {
            "code": 404,
            "type": "ModelNotFoundException",
            "message": "Model not found: comp@1",
        }


async def test_a_name_none_of_whose_copies_is_registered_is_not_found(
    port: TorchServePort,
) -> None:
    view = port.routes.state.sluice.view
    for copy in ("comp@1", "comp@2"):
        view.models[copy] = CatalogEntry(copy, (), None, UNLOADED, listed_as="comp")
    async with _client(port) as client:
        answers = [await client.request(method, path) for method, path in REQUESTS]
    for answer in answers:
        assert answer.status_code == 404, (answer.request.url, answer.text)
        assert answer.json()["message"] == "Model not found: comp"
