"""The HTTP routes: health, metadata, configuration, repository index, statistics, inference."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response

from gateway import infer as infer_path
from gateway.batch_routes import batch_router
from gateway.job_routes import job_router
from gateway.json_body import json_object, json_response
from gateway.label_routes import label_router
from gateway.logging_routes import logging_router
from gateway.metadata import model_metadata
from gateway.metrics import CONTENT_TYPE, metrics_text
from gateway.model_control_routes import model_control_router
from gateway.rollout_routes import rollout_router
from gateway.routing_routes import routing_router
from gateway.shm_routes import shm_router
from gateway.state import GatewayState, state_of
from sluice import __version__
from sluice.errors import InvalidInput, Unavailable
from sluice.statistics import render_model_stats

EXTENSIONS = [
    "classification",
    "binary_tensor_data",
    "model_configuration",
    "statistics",
    "schedule_policy",
    "system_shared_memory",
    "cuda_shared_memory",
    "logging",
]

router = APIRouter()
router.include_router(shm_router)
router.include_router(model_control_router)
router.include_router(rollout_router)
router.include_router(logging_router)
router.include_router(routing_router)
router.include_router(label_router)
router.include_router(job_router)
router.include_router(batch_router)

Handler = Callable[..., Awaitable[Response]]


@router.get("/v2/health/live")
async def live() -> Response:
    return json_response({"live": True})


@router.get("/v2/health/ready")
async def ready(request: Request) -> Response:
    state = state_of(request)
    if not state.redis_ok:
        return json_response({"error": "server is not ready: Redis is unreachable"}, 400)
    if not state.view.loaded:
        return json_response(
            {"error": "server is not ready: the model catalog is not loaded yet"}, 400
        )
    if state.settings.strict_readiness:
        waiting = state.view.not_ready()
        if waiting:
            return json_response({"error": f"server is not ready: {_listed(waiting)}"}, 400)
    return json_response({"ready": True})


def _listed(models: list[str], most: int = 5) -> str:
    shown = ", ".join(models[:most])
    more = f" and {len(models) - most} more" if len(models) > most else ""
    return f"model(s) not ready: {shown}{more}"


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    """Triton's metric families (see gateway.metrics), for Prometheus."""
    state = state_of(request)
    if not state.settings.allow_metrics:
        return json_response({"error": "metrics are turned off (SLUICE_ALLOW_METRICS=false)"}, 404)
    return Response(await metrics_text(state), media_type=CONTENT_TYPE)


@router.get("/v2")
async def server_metadata() -> Response:
    return json_response({"name": "sluice", "version": __version__, "extensions": EXTENSIONS})


@router.post("/v2/repository/index")
async def repository_index(request: Request) -> Response:
    state = state_of(request)
    document = json_object(await request.body(), empty_ok=True)
    ready_only = document.get("ready", False)
    if not isinstance(ready_only, bool):
        raise InvalidInput("'ready' must be a boolean")
    rows: list[dict[str, Any]] = []
    for name in sorted(state.view.models):
        entry = state.view.models[name]
        if not entry.available:
            if not ready_only:
                rows.append({"name": name, "state": "UNAVAILABLE", "reason": entry.error or ""})
            continue
        for version in entry.versions:
            error = state.view.load_error(name, version)
            if state.view.is_ready(name, version):
                row = {"name": name, "version": str(version), "state": "READY", "reason": ""}
            elif error is not None:
                row = {
                    "name": name,
                    "version": str(version),
                    "state": "UNAVAILABLE",
                    "reason": error,
                }
            else:
                row = {"name": name, "version": str(version), "state": "LOADING", "reason": ""}
            if not ready_only or row["state"] == "READY":
                rows.append(row)
    return json_response(rows)


async def _stats_for(state: GatewayState, models: list[tuple[str, int]]) -> Response:
    async with state.redis.pipeline(transaction=False) as pipe:
        for name, version in models:
            pipe.hgetall(state.keys.stats(name, version))
            pipe.hgetall(state.keys.batch_stats(name, version))
            pipe.hgetall(state.keys.instance_stats(name, version))
        results = await pipe.execute()
    stats = [
        render_model_stats(name, version, *results[3 * i : 3 * i + 3])
        for i, (name, version) in enumerate(models)
    ]
    return json_response({"model_stats": stats})


@router.get("/v2/models/stats")
async def all_stats(request: Request) -> Response:
    state = state_of(request)
    models = [
        (entry.name, version)
        for entry in state.view.models.values()
        if entry.available
        for version in entry.versions
    ]
    return await _stats_for(state, sorted(models))


def _versioned(path: str) -> list[str]:
    return [f"/v2/models/{{model}}{path}", f"/v2/models/{{model}}/versions/{{version}}{path}"]


def _route(method: str, suffix: str) -> Callable[[Handler], Handler]:
    def register(handler: Handler) -> Handler:
        for path in _versioned(suffix):
            router.add_api_route(path, handler, methods=[method], include_in_schema=True)
        return handler

    return register


@_route("GET", "")
async def metadata(request: Request, model: str, version: str | None = None) -> Response:
    state = state_of(request)
    if version is None:
        entry = state.view.entry(model)
        if not entry.available:
            raise Unavailable(f"model '{model}' is unavailable: {entry.error}")
        return json_response(model_metadata(entry, list(entry.versions)))
    entry, number = state.view.resolve(model, version)
    return json_response(model_metadata(entry, [number]))


@_route("GET", "/ready")
async def model_ready(request: Request, model: str, version: str | None = None) -> Response:
    """Triton answers 400 "Model version not ready" for a known model that cannot serve."""
    state = state_of(request)
    try:
        entry, number = state.view.resolve(model, version)
    except Unavailable as exc:
        return json_response({"error": f"Model version not ready; {exc.message}"}, 400)
    if not state.view.is_ready(model, number):
        detail = f"model '{model}' version {number} has no live worker yet"
        return json_response({"error": f"Model version not ready; {detail}"}, 400)
    return json_response({"name": entry.name, "ready": True})


@_route("GET", "/config")
async def model_config(request: Request, model: str, version: str | None = None) -> Response:
    entry, _ = state_of(request).view.resolve(model, version)
    assert entry.config is not None
    return json_response(dict(entry.config.raw))


@_route("GET", "/stats")
async def model_stats(request: Request, model: str, version: str | None = None) -> Response:
    state = state_of(request)
    if version is None:
        entry = state.view.entry(model)
        return await _stats_for(state, [(model, v) for v in entry.versions])
    _, number = state.view.resolve(model, version)
    return await _stats_for(state, [(model, number)])


@_route("POST", "/infer")
async def model_infer(request: Request, model: str, version: str | None = None) -> Response:
    return await infer_path.infer(request, state_of(request), model, version)
