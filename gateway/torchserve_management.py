"""TorchServe's management API on Sluice's model control (``sluice up
--model-control-mode explicit``), on the same port as everything else, with admin keys:

- ``GET /models``: every model, as TorchServe lists them;
- ``GET /models/{m}[/{v}]``: a model's description, with its workers;
- ``POST /models?url=<archive>.mar[&model_name=&batch_size=&max_batch_delay=
  &initial_workers=&response_timeout=]``: register an archive of the model store
  (``SLUICE_MODEL_STORE``, TorchServe's ``--model-store``) or from a URL the operator
  allows (``SLUICE_ALLOWED_MODEL_URLS``, TorchServe's ``allowed_urls``), and load it;
- ``PUT /models/{m}[/{v}]?min_worker=&max_worker=``: scale; the controller's autoscaling
  keeps the instances between the two (:mod:`sluice.scheduler.controller.autoscaling`), for
  every version;
- ``DELETE /models/{m}[/{v}]``: unregister (unload);
- ``PUT /models/{m}/{v}/set-default``: requests naming no version go to ``v``.

Versions are Sluice's (Triton's numbered folders); a registered archive is version 1.
"""

from __future__ import annotations

import asyncio
import re
import tempfile
from pathlib import Path
from typing import Any

import httpx
import orjson
from fastapi import APIRouter, Request, Response

from sluice.core.catalog import CatalogEntry
from sluice.core.clock import CLOCK
from sluice.core.config import config_to_json, parse_config_text
from sluice.core.control import ControlCommand
from sluice.core.errors import InvalidInput, NotFound, SluiceError
from sluice.core.mar import MarManifest, read_manifest, triton_config
from sluice.core.routing import Routing, check_served
from sluice.gateway.json_body import json_response
from sluice.gateway.model_control import carry_out, require_explicit
from sluice.gateway.routing_routes import _update
from sluice.gateway.state import GatewayState, state_of

router = APIRouter()

MAX_REGISTER_BYTES = 256 << 20
"""A registered archive travels to ``sluice up`` in a control command; a larger one is laid
out with ``sluice import-mar`` instead."""
_MIN, _MAX = "sluice.min_instances", "sluice.max_instances"


def _error(error: SluiceError) -> Response:
    body = {"code": int(error.status), "type": type(error).__name__, "message": error.message}
    return json_response(body, int(error.status))


def _version(text: str, served: tuple[int, ...], model: str) -> int:
    """A version from the path: Sluice's number, or TorchServe's ``N.0`` for it."""
    digits = text[:-2] if text.endswith(".0") else text
    if not digits.isascii() or not digits.isdigit() or len(digits) > 18 or int(digits) < 1:
        raise InvalidInput(f"'{text}' is not a version of model '{model}' (a number such as 1)")
    return check_served(int(digits), served, model)


def _whole(request: Request, name: str, default: int, least: int = 0) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = least - 1
    if value < least or value > 1_000_000:
        raise InvalidInput(f"'{name}' must be a whole number of at least {least}, got {raw!r}")
    return value


async def _workers(state: GatewayState, model: str, versions: tuple[int, ...]) -> list[Any]:
    workers = []
    now = CLOCK.now()
    for version in versions:
        members = await state.control.live_workers(model, version, now)
        for member in members:
            name = member.decode() if isinstance(member, bytes) else str(member)
            pid = name.rsplit("-", 2)[-2] if name.count("-") >= 2 else ""
            workers.append(
                {
                    "id": name,
                    "status": "READY",
                    "pid": int(pid) if pid.isdigit() else None,
                    "gpu": False,
                    "version": str(version),
                }
            )
    return workers


@router.get("/models")
async def list_models(request: Request) -> Response:
    state = state_of(request)
    models = [{"modelName": name, "modelUrl": f"{name}.mar"} for name in sorted(state.view.models)]
    return json_response({"models": models})


@router.get("/models/{model}")
@router.get("/models/{model}/{version}")
async def describe(request: Request, model: str, version: str | None = None) -> Response:
    state = state_of(request)
    try:
        entry = state.view.entry(model)
        versions = entry.versions
        if version not in (None, "all"):
            versions = (_version(version, entry.versions, model),)
        config = entry.config
        dynamic = config.dynamic_batching if config else None
        parameters = config.parameters if config else {}
        instances = config.total_instances if config else 0
        workers = await _workers(state, model, versions)
        answer = [
            {
                "modelName": model,
                "modelVersion": str(v),
                "modelUrl": f"{model}.mar",
                "runtime": "python",
                "minWorkers": int(parameters.get(_MIN, instances)),
                "maxWorkers": int(parameters.get(_MAX, instances)),
                "batchSize": max(1, config.max_batch_size) if config else 1,
                "maxBatchDelay": (dynamic.max_queue_delay_us // 1000) if dynamic else 0,
                "status": entry.error or ("READY" if entry.available else "UNAVAILABLE"),
                "workers": [w for w in workers if w["version"] == str(v)],
            }
            for v in versions
        ]
        return json_response(answer)
    except SluiceError as exc:
        return _error(exc)


@router.post("/models")
async def register(request: Request) -> Response:
    state = state_of(request)
    try:
        await require_explicit(state)
        url = request.query_params.get("url", "")
        if "://" in url:
            data = await _fetch(url, state.settings.allowed_model_urls)
        else:
            data = await asyncio.to_thread(_from_store, url, state.settings.model_store)
        manifest = await asyncio.to_thread(_manifest, data, url)
        name = request.query_params.get("model_name") or manifest.model_name
        workers = _whole(request, "initial_workers", 1, least=1)
        text = triton_config(
            name,
            _whole(request, "batch_size", 1, least=1),
            _whole(request, "max_batch_delay", 100),
            workers=workers,
            response_timeout_s=_whole(request, "response_timeout", 0),
        )
        config = config_to_json(parse_config_text(text, model_name=name))
        files = {"1/model.mar": data}
        await carry_out(state, ControlCommand("load", name, orjson.dumps(config).decode(), files))
        message = f'Model "{name}" Version: 1 registered with {workers} initial workers'
        return json_response({"status": message})
    except SluiceError as exc:
        return _error(exc)


def _too_large(url: str) -> InvalidInput:
    return InvalidInput(
        f"'{url}' is larger than {MAX_REGISTER_BYTES >> 20} MiB: lay it out with "
        "`sluice import-mar` instead"
    )


def _from_store(url: str, store: Path | None) -> bytes:
    """An archive of the model store, named by its file name."""
    if store is None:
        raise InvalidInput("no model store is set (SLUICE_MODEL_STORE): nothing to register")
    if not url or "/" in url or "\\" in url or url.startswith("."):
        raise InvalidInput("'url' must name an archive of the model store (a file name)")
    path = Path(store) / url
    if not path.is_file() or path.is_symlink():
        raise NotFound(f"model archive '{url}' is not in the model store")
    if path.stat().st_size > MAX_REGISTER_BYTES:
        raise _too_large(url)
    return path.read_bytes()


async def _fetch(url: str, allowed: str) -> bytes:
    """An archive from a URL the operator allows (``SLUICE_ALLOWED_MODEL_URLS``: regular
    expressions, comma-separated, matched against the whole URL; none by default)."""
    patterns = [p.strip() for p in allowed.split(",") if p.strip()]
    if not url.startswith(("http://", "https://")) or not any(
        re.fullmatch(pattern, url) for pattern in patterns
    ):
        raise InvalidInput(
            f"'url' {url[:200]!r} is not an allowed URL (SLUICE_ALLOWED_MODEL_URLS); an "
            "archive of the model store is named by its file name"
        )
    chunks: list[bytes] = []
    size = 0
    try:
        async with (
            httpx.AsyncClient(timeout=60, follow_redirects=False) as client,
            client.stream("GET", url) as response,
        ):
            if response.status_code != 200:
                raise NotFound(f"'{url}' answered HTTP {response.status_code}")
            async for chunk in response.aiter_bytes():
                size += len(chunk)
                if size > MAX_REGISTER_BYTES:
                    raise _too_large(url)
                chunks.append(chunk)
    except httpx.HTTPError as exc:
        raise NotFound(f"cannot download '{url}': {type(exc).__name__}") from None
    return b"".join(chunks)


def _manifest(data: bytes, url: str) -> MarManifest:
    with tempfile.TemporaryDirectory() as scratch:
        name = url.rsplit("/", 1)[-1] or "model.mar"
        path = Path(scratch) / (name if name.endswith(".mar") else "model.mar")
        path.write_bytes(data)
        return read_manifest(path)


async def _managed(state: GatewayState, model: str, version: str | None) -> CatalogEntry:
    """A model that model control may change (explicit mode), and the version named, if
    any, served."""
    await require_explicit(state)
    entry = state.view.entry(model)
    if version is not None:
        _version(version, entry.versions, model)
    return entry


@router.put("/models/{model}")
@router.put("/models/{model}/{version}")
async def scale(request: Request, model: str, version: str | None = None) -> Response:
    """Instances are per model here (every served version gets the same range)."""
    state = state_of(request)
    try:
        entry = await _managed(state, model, version)
        if entry.config is None:
            raise InvalidInput(f"model '{model}' is unavailable: {entry.error}")
        current = entry.config
        minimum = _whole(request, "min_worker", 1, least=0)
        maximum = _whole(request, "max_worker", max(minimum, 1), least=1)
        if minimum > maximum:
            raise InvalidInput("'min_worker' must not exceed 'max_worker'")
        config = config_to_json(current)
        parameters = dict(config.get("parameters", {}))
        parameters[_MIN] = {"string_value": str(minimum)}
        parameters[_MAX] = {"string_value": str(maximum)}
        config["parameters"] = parameters
        await carry_out(state, ControlCommand("load", model, orjson.dumps(config).decode()))
        return json_response({"status": f"Processing worker updates for model {model}"}, 202)
    except SluiceError as exc:
        return _error(exc)


@router.delete("/models/{model}")
@router.delete("/models/{model}/{version}")
async def unregister(request: Request, model: str, version: str | None = None) -> Response:
    state = state_of(request)
    try:
        await _managed(state, model, version)
        await carry_out(state, ControlCommand("unload", model))
        shown = f" version: {version}" if version else ""
        return json_response({"status": f'Model "{model}"{shown} unregistered'})
    except SluiceError as exc:
        return _error(exc)


@router.put("/models/{model}/{version}/set-default")
async def set_default(request: Request, model: str, version: str) -> Response:
    state = state_of(request)
    try:
        entry = state.view.entry(model)
        number = _version(version, entry.versions, model)
        await _update(state, model, lambda current: Routing(current.labels, {number: 100}))
        message = f'Default version successfully updated for model "{model}" to "{number}"'
        return json_response({"status": message})
    except SluiceError as exc:
        return _error(exc)
