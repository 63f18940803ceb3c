"""A registration (``POST /models``) checks the archive's manifest ``runtime`` as TorchServe's
``ModelArchive.validate`` does: one it does not know (``null``, ``java``) is its 400
``Runtime is not defined or invalid.``, unless the registration's ``runtime`` parameter
names one (TorchServe sets it on the manifest before it checks); none at all is its default,
``python``."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path
from typing import Any

import httpx
import pytest

from sluice.core.settings import GatewaySettings
from sluice.core.torchserve.archives import MANIFEST
from sluice.gateway.torchserve.management import router as management
from sluice.gateway.torchserve.ports import TorchServePort, management_path
from tests.support.onnx_models import identity_config
from tests.unit.gateway.in_process import EchoDispatcher, in_process_gateway
from tests.unit.gateway.memory_control_plane import MemoryControlPlane

ABSENT = object()
"""A manifest without ``runtime``."""


def _store(store: Path, runtime: Any) -> None:
    manifest: dict[str, Any] = {
        "model": {"modelName": "shout", "handler": "h.py", "modelVersion": "1.0"}
    }
    if runtime is not ABSENT:
        manifest["runtime"] = runtime
    with zipfile.ZipFile(store / "shout.mar", "w") as archive:
        archive.writestr(MANIFEST, json.dumps(manifest))
        archive.writestr("h.py", "def handle(data, context):\n    return data\n")


@pytest.fixture
def control() -> MemoryControlPlane:
    return MemoryControlPlane(explicit=True)


def _port(control: MemoryControlPlane, store: Path) -> TorchServePort:
    app = in_process_gateway(
        "alone",
        identity_config("alone", ["FP32"], [-1], 8),
        EchoDispatcher(["OUT_FP32"]),
        GatewaySettings(model_store=store),
        control=control,
    )
    app.app.include_router(management)
    return TorchServePort(app, app.app, management_path)


async def _register(port: TorchServePort, query: str) -> httpx.Response:
    transport = httpx.ASGITransport(app=port)
    async with httpx.AsyncClient(transport=transport, base_url="http://ts") as client:
        return await client.post(f"/models?url=shout.mar&{query}")


@pytest.mark.parametrize("runtime", [None, "java", "python2", "", 3])
async def test_a_runtime_torchserve_does_not_know_is_refused(
    control: MemoryControlPlane, tmp_path: Path, runtime: Any
) -> None:
    _store(tmp_path, runtime)
    answer = await _register(_port(control, tmp_path), "initial_workers=1&synchronous=false")
    assert answer.status_code == 400, answer.text
    assert answer.json() == {
        "code": 400,
        "type": "BadRequestException",
        "message": "model archive shout.mar: Runtime is not defined or invalid.",
    }
    assert control.commands == []  # (nothing loaded)


@pytest.mark.parametrize(
    ("runtime", "query"),
    [
        (ABSENT, ""),  # (TorchServe's manifest is python until read)
        ("python3", ""),
        (None, "&runtime=python"),
        ("java", "&runtime=python3"),
    ],
)
async def test_a_known_or_default_runtime_or_one_asked_is_registered(
    control: MemoryControlPlane, tmp_path: Path, runtime: Any, query: str
) -> None:
    _store(tmp_path, runtime)
    port = _port(control, tmp_path)
    answer = await _register(port, f"initial_workers=1&synchronous=false{query}")
    assert answer.status_code == 202, answer.text
    assert len(control.commands) == 1
