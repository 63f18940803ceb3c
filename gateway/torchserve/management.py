"""TorchServe's management API on Sluice's model control (``sluice up
--model-control-mode explicit``), on the same port as everything else, with admin keys, and
with TorchServe's answers (its frontend's status codes and messages):

- ``GET /models[?limit=&next_page_token=]``: the registered models (default versions);
- ``GET /models/{m}[/{v}|/all]``: a model's description (its default version, the one
  named, or all), with its workers;
- ``POST /models?url=...``: register an archive (:mod:`sluice.gateway.torchserve.archives`)
  and load it; ``model_name``, ``handler`` (instead of the manifest's), ``runtime``
  (python, python3), ``batch_size``, ``max_batch_delay``, ``initial_workers``,
  ``response_timeout``, ``startup_timeout`` and ``synchronous`` (default true), in the
  query or as a JSON body. An archive of a name already served adds a version
  (the manifest's ``modelVersion``); the same version again is a 409;
- ``PUT /models/{m}[/{v}]?min_worker=&max_worker=&synchronous=``: scale; 202 at once, or
  200 once scaled when synchronous;
- ``DELETE /models/{m}[/{v}]``: unregister a version (the default one, unless named: the
  default of several cannot go, 403), the model with its last version;
- ``PUT /models/{m}/{v}/set-default``: requests naming no version go to ``v``.

As TorchServe, a version is named in the path only (``?version=`` is not read), by its
exact text (``2`` and ``2.0`` are two versions), and a version the model does not serve is
its 404, a name that is no number (``abc``) too. With model namespacing, a name several
repositories hold is refused on every route that names it, registration included
(:mod:`.models`).

As TorchServe reads them, a query number that is not one (``batch_size=dd``) takes its
default, and so does ``synchronous`` that is not ``true`` or ``false``. Where TorchServe
answers plainly wrong (500 for a negative ``min_worker``) Sluice answers 400. Sluice's
batching and workers are per model, shared by its versions; a model always has a worker
when it is registered (``initial_workers`` 0: it stops when idle, and starts again on
demand), so a handler that cannot load fails the registration. TorchServe versions are
Sluice's numbered ones: :mod:`sluice.core.torchserve.versions`.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any

import orjson
from fastapi import APIRouter, Request, Response

from sluice.core.catalog import UNLOADED, CatalogEntry
from sluice.core.clock import CLOCK
from sluice.core.config import config_to_json, parse_config_text
from sluice.core.control import ControlCommand, encode_command
from sluice.core.errors import (
    Conflict,
    Forbidden,
    InferenceFailed,
    InvalidInput,
    NotFound,
    SluiceError,
)
from sluice.core.routing import Routing
from sluice.core.torchserve.archives import RUNTIMES, registered_runtime
from sluice.core.torchserve.config import MAX_WORKERS, check_model_name, triton_config
from sluice.core.torchserve.settings import ArchiveSettings
from sluice.core.torchserve.versions import VersionRecord, find, number_for, record_of
from sluice.gateway.control.catalog_follow import follow_changes
from sluice.gateway.control.model_control import carry_out, require_explicit
from sluice.gateway.http.body import read_body
from sluice.gateway.http.json_body import json_response
from sluice.gateway.http.routing_routes import update_routing
from sluice.gateway.state import GatewayState, state_of
from sluice.gateway.torchserve.api_description import model_api
from sluice.gateway.torchserve.archives import Archive, find_archive
from sluice.gateway.torchserve.config import (
    with_batching,
    with_versions,
    with_workers,
    workers_of,
)
from sluice.gateway.torchserve.exception_types import ModelVersionNotFound
from sluice.gateway.torchserve.models import (
    listed,
    registered,
    registrable,
    served_versions,
    version_number,
)
from sluice.gateway.torchserve.ports import management_path
from sluice.gateway.torchserve.route_docs import Kind, json_body, query
from sluice.gateway.torchserve.routes import error_response

log = logging.getLogger(__name__)

router = APIRouter()

_MAX_REGISTER_JSON = 64 << 10


class WorkersFailed(InferenceFailed):
    """TorchServe's 500 when a model's workers do not start (an ``InternalServerException``
    in its body's ``type``)."""


_INT = re.compile(r"[+-]?[0-9]{1,10}")
_INT_RANGE = range(-(1 << 31), 1 << 31)


def _whole(params: dict[str, str], name: str) -> int | None:
    """A number of the query as TorchServe reads one (a Java int): None when absent, not a
    number, or beyond an int's range (``response_timeout=10**30`` overflowed the
    configuration's fields: a 500 when it came with a second version)."""
    raw = params.get(name)
    if raw is None or not _INT.fullmatch(raw.strip()):
        return None
    value = int(raw.strip())
    return value if value in _INT_RANGE else None


_MOST = 1_000_000


def _at_least(params: dict[str, str], name: str, least: int) -> int | None:
    """A setting given as a number, refused below ``least`` (or above :data:`_MOST`)."""
    value = _whole(params, name)
    if value is not None and not least <= value <= _MOST:
        raise InvalidInput(f"'{name}' must be a whole number from {least} to {_MOST}, got {value}")
    return value


def _flag(params: dict[str, str], name: str, default: bool) -> bool:
    """Java's Boolean.parseBoolean, as TorchServe reads its flags."""
    raw = params.get(name)
    return default if raw is None else raw.strip().lower() == "true"


async def current_state(request: Request) -> GatewayState:
    """The gateway's state, caught up with what another gateway process of this host has
    changed (a registration through one connection is seen through the next)."""
    state = state_of(request)
    await follow_changes(state)
    return state


def _default(state: GatewayState, entry: CatalogEntry) -> int:
    """The version requests naming none go to: the heaviest of the model's split, else
    the newest."""
    weights = state.view.routing.get(entry.name).weights
    chosen = [v for v in sorted(weights, key=lambda v: (weights[v], v)) if v in entry.versions]
    return chosen[-1] if chosen and weights[chosen[-1]] > 0 else entry.versions[-1]


async def _workers(state: GatewayState, model: str, version: int) -> list[dict[str, Any]]:
    workers = []
    for member in await state.control.live_workers(model, version, CLOCK.now()):
        name = member.decode() if isinstance(member, bytes) else str(member)
        pid = name.rsplit("-", 2)[-2] if name.count("-") >= 2 else ""
        workers.append(
            {
                "id": name,
                "status": "READY",
                "pid": int(pid) if pid.isdigit() else None,
                "gpu": False,
            }
        )
    return workers


PAGES = query(
    limit=("integer", "At most this many (0 to 100; default 100)"),
    next_page_token=("integer", "Where the page starts: the previous page's nextPageToken"),
)
"""The query of TorchServe's lists (models, workflows)."""


@router.get("/models", openapi_extra=PAGES)
async def list_models(request: Request) -> Response:
    state = await current_state(request)
    params = dict(request.query_params)
    limit = _whole(params, "limit")
    limit = 100 if limit is None or not 0 <= limit <= 100 else limit
    token = max(0, _whole(params, "next_page_token") or 0)
    names_of = listed(state.view)
    names = sorted(names_of)
    last = token + limit
    models = []
    for name in names[token:last]:
        entry = state.view.models[names_of[name]]
        url = f"{name}.mar"
        if entry.config is not None and entry.versions:
            url = record_of(entry.config.parameters, _default(state, entry)).url or url
        models.append({"modelName": name, "modelUrl": url})
    answer: dict[str, Any] = {"models": models}
    if last <= len(names):
        answer["nextPageToken"] = str(last)
    return json_response(answer)


@router.get("/models/{model}")
async def describe(request: Request, model: str) -> Response:
    """The model's default version (TorchServe reads no version from the query)."""
    return await _describe(request, model, None)


@router.get("/models/{model}/{version}")
async def describe_version(request: Request, model: str, version: str) -> Response:
    """The version named, or all of them (``all``)."""
    return await _describe(request, model, version)


async def _describe(request: Request, model: str, version: str | None) -> Response:
    try:
        state = await current_state(request)
        entry = registered(state, model)
        if not entry.versions:
            raise NotFound(f"Model not found: {model} ({entry.error})")
        if version == "all":
            numbers = entry.versions
        else:
            numbers = (
                _default(state, entry) if version is None else version_number(entry, version),
            )
        return json_response([await _description(state, entry, n) for n in numbers])
    except SluiceError as exc:
        return error_response(exc)


async def _description(state: GatewayState, entry: CatalogEntry, number: int) -> dict[str, Any]:
    config = entry.config
    parameters = config.parameters if config is not None else {}
    record = record_of(parameters, number)
    dynamic = config.dynamic_batching if config is not None else None
    minimum, maximum = workers_of(config) if config is not None else (0, 0)
    gpu = config is not None and any(g.kind == "KIND_GPU" for g in config.instance_groups)
    workers = await _workers(state, entry.name, number)
    return {
        "modelName": entry.name,
        "modelVersion": record.version,
        "modelUrl": record.url or f"{entry.name}.mar",
        "runtime": record.runtime or "python",
        "minWorkers": minimum,
        "maxWorkers": maximum,
        "batchSize": max(1, config.max_batch_size) if config is not None else 1,
        "maxBatchDelay": (dynamic.max_queue_delay_us // 1000) if dynamic is not None else 0,
        "responseTimeout": (dynamic.default_timeout_us // 1_000_000) if dynamic else 0,
        "deviceType": "gpu" if gpu else "cpu",
        "status": entry.error or ("READY" if entry.available else "UNAVAILABLE"),
        "workers": [{**w, "gpu": gpu} for w in workers],
    }


async def register_params(request: Request, state: GatewayState) -> dict[str, str]:
    """The registration's parameters: the query's, or a JSON body's (as TorchServe takes
    them, by the same names)."""
    params = dict(request.query_params)
    if request.headers.get("content-type", "").split(";")[0].strip() != "application/json":
        return params
    raw = await read_body(request, min(_MAX_REGISTER_JSON, state.settings.max_body_bytes))
    try:
        document = orjson.loads(raw) if raw else {}
    except orjson.JSONDecodeError as exc:
        raise InvalidInput(f"the registration's JSON body is not JSON: {exc}") from None
    if not isinstance(document, dict):
        raise InvalidInput("the registration's JSON body must be an object")
    for key, value in document.items():
        if isinstance(value, bool):
            params[key] = "true" if value else "false"
        elif isinstance(value, int | float | str):
            params[key] = str(value)
    return params


async def registration(request: Request) -> tuple[GatewayState, dict[str, str], str]:
    """A registration's state, parameters and ``url`` (models' and workflows' alike)."""
    state = await current_state(request)
    await require_explicit(state)
    params = await register_params(request, state)
    url = params.get("url")
    if url is None:
        raise InvalidInput("Parameter url is required.")
    return state, params, url


_REGISTRATION = {
    **query(
        url=("string", "The archive: a file of the model store, or an allowed URL (required)"),
        model_name=("string", "The model's name, instead of the manifest's"),
        handler=("string", "The handler, instead of the manifest's"),
        runtime=("string", "python or python3"),
        batch_size=("integer", "The largest batch (default: the archive's, else 1)"),
        max_batch_delay=("integer", "Milliseconds a batch waits to fill (default 100)"),
        response_timeout=("integer", "Seconds an inference may take"),
        initial_workers=("integer", "Workers kept running (0: one, while requests come)"),
        startup_timeout=("integer", "Seconds the workers may take to start"),
        synchronous=("boolean", "Answer once loaded (default true), or at once with 202"),
    ),
    **json_body("The same parameters as a JSON object, instead of the query"),
}


@router.post("/models", openapi_extra=_REGISTRATION)
async def register(request: Request) -> Response:
    try:
        state, params, url = await registration(request)
        runtime = params.get("runtime")
        if runtime is not None and runtime not in RUNTIMES:
            raise InvalidInput(
                f"Invalid RuntimeType value: {runtime} (one of {', '.join(RUNTIMES)})"
            )
        archive = await find_archive(
            url, state.settings.model_store, state.settings.allowed_model_urls
        )
        return await register_archive(state, params, url, archive)
    except SluiceError as exc:
        return error_response(exc)


@dataclass(frozen=True, slots=True)
class _Asked:
    """What a registration asks for beside the archive (None: not given, or no number)."""

    batch_size: int | None
    delay_ms: int | None
    timeout_s: int | None
    initial: int | None
    startup_s: int | None

    @classmethod
    def of(cls, params: dict[str, str]) -> _Asked:
        timeout_s = _whole(params, "response_timeout")
        return cls(
            _at_least(params, "batch_size", 1),
            _at_least(params, "max_batch_delay", 0),
            None if timeout_s is not None and timeout_s < 0 else timeout_s,  # -1: the default
            _whole(params, "initial_workers"),
            _whole(params, "startup_timeout"),
        )


async def register_archive(
    state: GatewayState,
    params: dict[str, str],
    url: str,
    archive: Archive,
    *,
    max_workers: int | None = None,
) -> Response:
    """Register ``archive`` (found at ``url``) as ``params`` ask (a registration's query,
    or a workflow's node); TorchServe's answer. ``max_workers``: the most workers
    autoscaling may start (a workflow's node; a registration's query has no such
    parameter)."""
    manifest, settings = archive.manifest, archive.settings
    name = params.get("model_name") or manifest.model_name
    check_model_name(name, f"model archive {url.rsplit('/', 1)[-1]}")
    registered_runtime(manifest, params.get("runtime"), url.rsplit("/", 1)[-1])
    line = settings.ignored_line(name)
    if line:
        log.warning("%s", line)
    entry = registrable(state, name)
    if entry is not None and (
        entry.error == UNLOADED or not entry.versions or entry.config is None
    ):
        entry = None  # not loaded (or failed): registered anew
    served = served_versions(entry) if entry is not None else {}
    if entry is not None and entry.config is not None and entry.config.backend != "torchserve":
        raise Conflict(f"model '{name}' is served already, and not from a TorchServe archive")
    if find(manifest.version, served) is not None:
        raise Conflict(f"Model version {manifest.version} is already registered for model {name}")
    number = number_for(manifest.version, served, f"model archive {url}")
    record = VersionRecord(
        manifest.version, url, params.get("handler", ""), params.get("runtime", "")
    )
    asked = _Asked.of(params)
    starts = (asked.initial or 0) > 0 or bool(settings.min_workers and entry is None)
    if starts and asked.startup_s is not None and asked.startup_s != -1 and asked.startup_s <= 0:
        # TorchServe gives the workers no time at all to start: they fail, and the model
        # is not registered.
        raise WorkersFailed(
            f"Failed to start workers for model {name} version: {manifest.version} "
            f"(startup_timeout {asked.startup_s})"
        )
    files = {f"{number}/model.mar": archive.data}
    if entry is None:
        minimum, maximum = _initial_workers(asked.initial, settings)
        if max_workers is not None:
            maximum = max(minimum, min(max_workers, MAX_WORKERS))
        config = _new_model(name, asked, settings, minimum, maximum, {number: record})
        command = ControlCommand("load", name, orjson.dumps(config).decode(), files)
    else:
        minimum, maximum = _initial_workers(asked.initial, ArchiveSettings())
        config = _added_version(entry, asked, served, minimum, maximum, {number: record})
        command = ControlCommand(
            "load", name, orjson.dumps(config).decode(), files, keep_files=True
        )
        default = _default(state, entry)  # stays the default, as in TorchServe
        await update_routing(state, name, lambda current: Routing(current.labels, {default: 100}))
    if starts and not _flag(params, "synchronous", True):
        # (With no workers to start, TorchServe answers at once whatever is asked.)
        await _send(state, command)
        return json_response({"status": "Processing worker updates..."}, 202)
    await _load(state, command, name, manifest.version)
    workers = f"{minimum} initial workers"
    if minimum == 0:
        workers += " (one serves while requests come, and stops when idle)"
    return json_response(
        {"status": f'Model "{name}" Version: {manifest.version} registered with {workers}'}
    )


def _new_model(
    name: str,
    asked: _Asked,
    settings: ArchiveSettings,
    minimum: int,
    maximum: int,
    versions: dict[int, VersionRecord],
) -> dict[str, Any]:
    """A new model's configuration: what the registration asks, else what the archive's
    model-config.yaml says, else TorchServe's defaults."""
    text = triton_config(
        name,
        asked.batch_size or settings.batch_size or 1,
        _or(asked.delay_ms, _or(settings.max_batch_delay_ms, 100)),
        workers=minimum,
        max_workers=maximum,
        response_timeout_s=_or(asked.timeout_s, _or(settings.response_timeout_s, 0)),
        gpu=bool(settings.gpu),
        versions=versions,
    )
    return config_to_json(parse_config_text(text, model_name=name))


def _added_version(
    entry: CatalogEntry,
    asked: _Asked,
    served: dict[int, str],
    minimum: int,
    maximum: int,
    added: dict[int, VersionRecord],
) -> dict[str, Any]:
    """A served model's configuration with one more version: the model's settings, with
    what the registration asks (for every version)."""
    assert entry.config is not None
    config = with_versions(config_to_json(entry.config), [*served, *added], added, None)
    config = with_batching(config, asked.batch_size, asked.delay_ms, asked.timeout_s)
    return with_workers(config, minimum, maximum) if asked.initial is not None else config


def _or(value: int | None, default: int) -> int:
    return default if value is None else value


def _initial_workers(initial: int | None, settings: ArchiveSettings) -> tuple[int, int]:
    """(minimum, maximum) workers of a registration: the archive's model-config.yaml when
    it names some (as TorchServe), else ``initial_workers`` (absent: one; 0 or less: none
    kept)."""
    low, high = settings.min_workers, settings.max_workers
    if low and (high is None or high >= low):
        return low, max(low, high or low)
    if initial is None:
        return 1, 1
    if initial <= 0:
        return 0, 1
    if initial > MAX_WORKERS:
        raise InvalidInput(f"'initial_workers' must be at most {MAX_WORKERS}, got {initial}")
    return initial, initial


async def _send(state: GatewayState, command: ControlCommand) -> None:
    """Hand a command to ``sluice up`` without waiting for it (TorchServe's asynchronous
    calls)."""
    await state.control.send_command(state.keys.control_requests, encode_command(command))


async def _load(state: GatewayState, command: ControlCommand, model: str, version: str) -> None:
    try:
        await carry_out(state, command)
    except InvalidInput as exc:
        raise WorkersFailed(
            f"Failed to start workers for model {model} version: {version}: {exc.message}"
        ) from None


_SCALE: dict[str, tuple[Kind, str]] = {
    "min_worker": ("integer", "Workers kept running (default 1)"),
    "max_worker": ("integer", "The most workers under load (default: min_worker)"),
    "synchronous": ("boolean", "Answer once scaled, or at once with 202 (default false)"),
}


@router.put(
    "/models/{model}",
    openapi_extra=query(**_SCALE, model_version=("string", "The version (default: the default)")),
)
async def scale(request: Request, model: str) -> Response:
    """Workers are per model here (every version served gets the same)."""
    return await _scale(request, model, None)


@router.put("/models/{model}/{version}", openapi_extra=query(**_SCALE))
async def scale_version(request: Request, model: str, version: str) -> Response:
    return await _scale(request, model, version)


async def _scale(request: Request, model: str, version: str | None) -> Response:
    params = dict(request.query_params)
    try:
        state = await current_state(request)
        minimum = _whole(params, "min_worker")
        minimum = 1 if minimum is None else minimum
        maximum = _whole(params, "max_worker")
        maximum = minimum if maximum is None else maximum
        if maximum < minimum:
            raise InvalidInput("max_worker cannot be less than min_worker.")
        await require_explicit(state)
        entry = registered(state, model)
        version = version or params.get("model_version")
        number = version_number(entry, version) if version is not None else _default(state, entry)
        if minimum < 0:
            raise InvalidInput(f"'min_worker' must be at least 0, got {minimum}")
        if maximum > MAX_WORKERS:
            raise InvalidInput(f"'max_worker' must be at most {MAX_WORKERS}, got {maximum}")
        if entry.config is None:
            raise InvalidInput(f"model '{model}' is unavailable: {entry.error}")
        config = with_workers(config_to_json(entry.config), minimum, maximum)
        command = ControlCommand("load", model, orjson.dumps(config).decode())
        if not _flag(params, "synchronous", False):
            await _send(state, command)
            return json_response({"status": "Processing worker updates..."}, 202)
        shown = record_of(entry.config.parameters, number).version
        await _load(state, command, model, shown)
        message = f"Workers scaled to {minimum} for model: {model}"
        if version is not None:
            message += f", version: {version}"
        return json_response({"status": message})
    except SluiceError as exc:
        return error_response(exc)


@router.delete("/models/{model}")
async def unregister(request: Request, model: str) -> Response:
    """The model's default version (the model, with its last one)."""
    return await _unregister(request, model, None)


@router.delete("/models/{model}/{version}")
async def unregister_version(request: Request, model: str, version: str) -> Response:
    return await _unregister(request, model, version)


async def _unregister(request: Request, model: str, version: str | None) -> Response:
    try:
        state = await current_state(request)
        await require_explicit(state)
        entry = registered(state, model)
        default = _default(state, entry) if entry.versions else None
        number = version_number(entry, version) if version is not None else default
        if len(entry.versions) > 1:
            if number == default:
                raise Forbidden(f"Cannot remove default version for model {model}")
            assert entry.config is not None and number is not None
            remaining = [v for v in entry.versions if v != number]
            config = with_versions(config_to_json(entry.config), remaining, {}, number)
            await carry_out(state, ControlCommand("load", model, orjson.dumps(config).decode()))
        else:
            await unload(state, model)
        return json_response({"status": f'Model "{model}" unregistered'})
    except SluiceError as exc:
        return error_response(exc)


async def unload(state: GatewayState, model: str) -> None:
    """Unregister ``model`` with all its versions."""
    await carry_out(state, ControlCommand("unload", model))
    await update_routing(state, model, lambda current: Routing(current.labels))


@router.put("/models/{model}/{version}/set-default")
async def set_default(request: Request, model: str, version: str) -> Response:
    try:
        state = await current_state(request)
        entry = registered(state, model)
        number = find(version, served_versions(entry))
        if number is None:
            # (TorchServe's words here, unlike its other routes', have no colons)
            raise ModelVersionNotFound(f"Model version {version} does not exist for model {model}")
        await update_routing(state, model, lambda current: Routing(current.labels, {number: 100}))
        message = f'Default version successfully updated for model "{model}" to "{version}"'
        return json_response({"status": message})
    except SluiceError as exc:
        return error_response(exc)


@router.options("/models/{model}")
async def model_description(request: Request, model: str) -> Response:
    """TorchServe's description of one model's management API."""
    return await _described(request, model, None)


@router.options("/models/{model}/{version}")
async def version_description(request: Request, model: str, version: str) -> Response:
    """The same, for a version of the model (404 when it has no such version)."""
    return await _described(request, model, version)


async def _described(request: Request, model: str, version: str | None) -> Response:
    try:
        document = await model_api(
            request, management_path, model, version, "RESTful Management API for: "
        )
    except SluiceError as exc:
        return error_response(exc)
    return Response(document, media_type="application/json")
