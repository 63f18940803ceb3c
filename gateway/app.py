"""The gateway application: one composition of the HTTP port, the metrics port and
TorchServe's ports.

A request passes the edge checks (:mod:`sluice.gateway.http.guard`), then inference goes to
the plain ASGI handler (:mod:`sluice.gateway.http.fast_path`) and every other route to the
FastAPI application,
which owns the one lifespan (:mod:`sluice.gateway.lifespan`) and the OpenAPI schema (inference
described there by :mod:`sluice.gateway.http.schema`). The metrics port answers ``GET /metrics``
from the same process state."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI
from starlette.types import ASGIApp

from sluice.core.request_parameters import forward_pattern
from sluice.core.restricted_api import parse_restrictions
from sluice.core.settings import GatewaySettings
from sluice.gateway.http.errors import add_error_handlers
from sluice.gateway.http.fast_path import InferFastPath
from sluice.gateway.http.generate_routes import router as generate_router
from sluice.gateway.http.guard import EdgeGuard
from sluice.gateway.http.routes import router
from sluice.gateway.http.schema import describe_inference
from sluice.gateway.lifespan import gateway_lifespan
from sluice.gateway.metrics.port import MetricsOnly
from sluice.gateway.tenants.keys import KeyRing
from sluice.gateway.torchserve.management import router as torchserve_management
from sluice.gateway.torchserve.ports import (
    TorchServeMetrics,
    TorchServePort,
    inference_path,
    management_path,
)
from sluice.gateway.torchserve.routes import router as torchserve_router
from sluice.gateway.torchserve.workflow_run import router as workflow_predictions
from sluice.gateway.torchserve.workflows import router as workflow_management


@dataclass(frozen=True)
class GatewayApp:
    http: ASGIApp
    """The HTTP port's application; it runs the lifespan."""
    metrics: ASGIApp
    """The metrics port's (no lifespan of its own: it reads the HTTP port's state)."""
    torchserve_inference: ASGIApp
    """TorchServe's inference port (its 8080), management port (8081) and metrics port
    (8082), when served (:mod:`sluice.gateway.torchserve.ports`); none has a lifespan."""
    torchserve_management: ASGIApp
    torchserve_metrics: ASGIApp
    exiting: asyncio.Event = field(default_factory=asyncio.Event)
    """Set by the server once it was asked to stop, before it drains its HTTP connections:
    the lifespan then drains gRPC at the same time, not after."""


class _RoutesApp(FastAPI):
    """The FastAPI application, whose schema also lists the inference routes."""

    def openapi(self) -> dict[str, Any]:
        return describe_inference(super().openapi())


def create_app(settings: GatewaySettings) -> GatewayApp:
    exiting = asyncio.Event()
    routes = _routes_app(settings, exiting)
    http = _guarded(settings, InferFastPath(routes))
    return GatewayApp(
        http=http,
        metrics=_guarded(settings, MetricsOnly(routes)),
        torchserve_inference=TorchServePort(http, routes, inference_path),
        torchserve_management=TorchServePort(http, routes, management_path),
        torchserve_metrics=_guarded(settings, TorchServeMetrics(routes)),
        exiting=exiting,
    )


def _guarded(settings: GatewaySettings, app: ASGIApp) -> ASGIApp:
    """``app`` behind the edge checks: header limits, API keys, control body limits."""
    return EdgeGuard(
        app,
        keys=KeyRing.from_settings(settings),
        max_header_count=settings.max_header_count,
        max_header_bytes=settings.max_header_bytes,
        max_control_body_bytes=settings.max_control_body_bytes,
        forward=forward_pattern(settings.http_header_forward_pattern),
        restricted=parse_restrictions(settings.http_restricted_api),
    )


def _routes_app(settings: GatewaySettings, exiting: asyncio.Event) -> FastAPI:
    app = _RoutesApp(title="Sluice", version="v2", lifespan=gateway_lifespan(settings, exiting))
    app.include_router(router)
    app.include_router(torchserve_router)
    app.include_router(generate_router)
    app.include_router(torchserve_management)
    app.include_router(workflow_management)
    app.include_router(workflow_predictions)
    add_error_handlers(app)
    return app
