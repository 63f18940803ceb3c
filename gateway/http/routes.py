"""The HTTP routes: health, metadata, configuration, repository index, statistics (inference
is served by :mod:`sluice.gateway.http.fast_path` and described by
:mod:`sluice.gateway.http.schema`)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response

from sluice import __version__
from sluice.gateway.control.catalog_follow import asked_fresh, is_problem
from sluice.gateway.control.inspection import (
    config_document,
    metadata_document,
    model_not_ready,
    repository_rows,
    server_not_ready,
    stats_document,
    stats_targets,
)
from sluice.gateway.control.server_extensions import EXTENSIONS
from sluice.gateway.http.json_body import json_object, json_response
from sluice.gateway.http.label_routes import label_router
from sluice.gateway.http.logging_routes import logging_router
from sluice.gateway.http.model_control_routes import model_control_router
from sluice.gateway.http.rollout_routes import rollout_router
from sluice.gateway.http.routing_routes import routing_router
from sluice.gateway.http.shm_routes import shm_router
from sluice.gateway.http.trace_routes import trace_router
from sluice.gateway.jobs.batch_routes import batch_router
from sluice.gateway.jobs.job_routes import job_router
from sluice.gateway.jobs.upload_routes import upload_router
from sluice.gateway.metrics.exposition import CONTENT_TYPE, metrics_text
from sluice.gateway.state import state_of

router = APIRouter()
router.include_router(shm_router)
router.include_router(model_control_router)
router.include_router(rollout_router)
router.include_router(logging_router)
router.include_router(routing_router)
router.include_router(label_router)
router.include_router(job_router)
router.include_router(batch_router)
router.include_router(upload_router)
router.include_router(trace_router)

Handler = Callable[..., Awaitable[Response]]


def _empty(status: int = 200) -> Response:
    """Triton's health answer: a status and no body (``content-length: 0``, no content type)."""
    return Response(status_code=status)


@router.get("/v2/health/live")
async def live() -> Response:
    return _empty()


@router.get("/v2/health/ready")
async def ready(request: Request) -> Response:
    """200 or 400, with no body either way, as Triton (which says nothing of why it is not
    ready: the repository index lists each model's state)."""
    state = state_of(request)
    problem = await asked_fresh(state, lambda: server_not_ready(state), is_problem)
    return _empty() if problem is None else _empty(400)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    """Triton's metric families (see sluice.gateway.metrics.exposition), for Prometheus."""
    state = state_of(request)
    if not state.settings.allow_metrics:
        return json_response({"error": "metrics are turned off (SLUICE_ALLOW_METRICS=false)"}, 404)
    return Response(await metrics_text(state), media_type=CONTENT_TYPE)


@router.get("/v2")
async def server_metadata() -> Response:
    return json_response({"name": "sluice", "version": __version__, "extensions": EXTENSIONS})


@router.post("/v2/repository/index")
async def repository_index(request: Request) -> Response:
    document = json_object(await request.body(), empty_ok=True)
    return json_response(repository_rows(state_of(request), document.get("ready", False)))


@router.get("/v2/models/stats")
async def all_stats(request: Request) -> Response:
    state = state_of(request)
    return json_response(await stats_document(state, stats_targets(state, "", None)))


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
    return json_response(await asked_fresh(state, lambda: metadata_document(state, model, version)))


@_route("GET", "/ready")
async def model_ready(request: Request, model: str, version: str | None = None) -> Response:
    """200 with no body, as Triton; 400 "Model version not ready" (with why) for a known
    model that cannot serve."""
    state = state_of(request)
    problem = await asked_fresh(state, lambda: model_not_ready(state, model, version), is_problem)
    if problem is not None:
        return json_response({"error": problem}, 400)
    return _empty()


@_route("GET", "/config")
async def model_config(request: Request, model: str, version: str | None = None) -> Response:
    state = state_of(request)
    return json_response(await asked_fresh(state, lambda: config_document(state, model, version)))


@_route("GET", "/stats")
async def model_stats(request: Request, model: str, version: str | None = None) -> Response:
    state = state_of(request)
    targets = await asked_fresh(state, lambda: stats_targets(state, model, version))
    return json_response(await stats_document(state, targets))
