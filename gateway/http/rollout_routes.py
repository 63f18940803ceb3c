"""Rollouts over HTTP (management endpoints, under ``/v2/repository/``):

- ``POST /v2/repository/models/{m}/rollout`` with ``{"version": 4, "steps": [10, 50],
  "step_s": 10, ...}`` (:class:`sluice.core.rollout.RolloutPlan`) starts one and answers its state;
- ``GET /v2/repository/models/{m}/rollout``: its state, with every decision and its numbers;
- ``POST .../rollout/promote`` and ``.../rollout/rollback``: decide now.

The leading controller carries them out (:mod:`sluice.scheduler.controller.rollouts`); the
state lives in Redis, so any gateway answers it.
"""

from __future__ import annotations

import orjson
from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response

from sluice.core.control import ControlCommand
from sluice.core.errors import NotFound
from sluice.core.rollout import PROMOTE, ROLLBACK, START, parse_start
from sluice.gateway.control.model_control import carry_out
from sluice.gateway.http.json_body import json_object
from sluice.gateway.state import state_of

rollout_router = APIRouter()


@rollout_router.post("/v2/repository/models/{model}/rollout")
async def start(model: str, request: Request) -> Response:
    state = state_of(request)
    document = json_object(await request.body())
    # Checked here too: a bad request is told at once, even while no controller leads (it
    # would wait for one, and be carried out when one comes).
    parse_start(document)
    command = ControlCommand(START, model, orjson.dumps(document).decode())
    await carry_out(state, command, state.keys.controller_requests)
    return await status(model, request)


@rollout_router.get("/v2/repository/models/{model}/rollout")
async def status(model: str, request: Request) -> Response:
    state = state_of(request)
    raw = await state.control.rollout(model)
    if raw is None:
        raise NotFound(f"no rollout of model '{model}'")
    return Response(raw, media_type="application/json")


@rollout_router.post("/v2/repository/models/{model}/rollout/promote")
async def promote(model: str, request: Request) -> Response:
    state = state_of(request)
    await carry_out(state, ControlCommand(PROMOTE, model), state.keys.controller_requests)
    return await status(model, request)


@rollout_router.post("/v2/repository/models/{model}/rollout/rollback")
async def rollback(model: str, request: Request) -> Response:
    state = state_of(request)
    await carry_out(state, ControlCommand(ROLLBACK, model), state.keys.controller_requests)
    return await status(model, request)
