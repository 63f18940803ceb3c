"""Triton's trace extension (``GET`` / ``POST /v2[/models/{m}]/trace/setting``, gRPC
``TraceSetting``), answered from Sluice's tracing: OpenTelemetry spans of every request,
exported to ``SLUICE_OTLP_ENDPOINT`` when one is set (see :mod:`sluice.core.tracing`). The
settings are reported under Triton's names and values; they are fixed by the process's
configuration, so a request to change one is refused (Triton without its tracing build
refuses the same way)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response

from sluice.core.errors import Unsupported
from sluice.core.tracing import traces_endpoint
from sluice.gateway.json_body import json_object, json_response
from sluice.gateway.state import GatewayState, state_of

trace_router = APIRouter()

FIXED = (
    "trace settings can not be updated through network protocol: Sluice traces every "
    "request with OpenTelemetry to SLUICE_OTLP_ENDPOINT, set when the gateway starts"
)


def trace_settings(state: GatewayState, model: str = "") -> dict[str, list[str]]:
    """The settings, each a list of strings as Triton's; ``model`` (when given) must exist."""
    if model:
        state.view.entry(model)
    on = bool(traces_endpoint(state.settings))
    return {
        "trace_mode": ["opentelemetry"],
        "trace_level": ["TIMESTAMPS"] if on else ["OFF"],
        "trace_rate": ["1"],
        "trace_count": ["-1"],
        "log_frequency": ["0"],
        "trace_file": [""],
    }


def refuse_changes(settings: dict[str, Any]) -> None:
    """A request that names any setting asks to change it: refused."""
    if settings:
        raise Unsupported(FIXED)


@trace_router.get("/v2/trace/setting")
@trace_router.get("/v2/models/{model}/trace/setting")
async def get_trace_settings(request: Request, model: str = "") -> Response:
    return json_response(trace_settings(state_of(request), model))


@trace_router.post("/v2/trace/setting")
@trace_router.post("/v2/models/{model}/trace/setting")
async def update_trace_settings(request: Request, model: str = "") -> Response:
    state = state_of(request)
    current = trace_settings(state, model)
    refuse_changes(json_object(await request.body(), empty_ok=True))
    return json_response(current)
