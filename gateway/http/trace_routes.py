"""``GET`` / ``POST /v2[/models/{m}]/trace/setting``: Triton's trace extension over REST
(the settings themselves: :mod:`sluice.gateway.control.trace_settings`)."""

from __future__ import annotations

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response

from sluice.gateway.control.catalog_follow import asked_fresh
from sluice.gateway.control.trace_settings import refuse_changes, trace_settings
from sluice.gateway.http.json_body import json_object, json_response
from sluice.gateway.state import state_of

trace_router = APIRouter()


@trace_router.get("/v2/trace/setting")
@trace_router.get("/v2/models/{model}/trace/setting")
async def get_trace_settings(request: Request, model: str = "") -> Response:
    state = state_of(request)
    return json_response(await asked_fresh(state, lambda: trace_settings(state, model)))


@trace_router.post("/v2/trace/setting")
@trace_router.post("/v2/models/{model}/trace/setting")
async def update_trace_settings(request: Request, model: str = "") -> Response:
    state = state_of(request)
    current = await asked_fresh(state, lambda: trace_settings(state, model))
    refuse_changes(json_object(await request.body(), empty_ok=True))
    return json_response(current)
