"""``GET`` / ``POST /v2/logging``: Triton's logging extension.

GET answers the settings under Triton's names (``log_file``, ``log_info``, ``log_warning``,
``log_error``, ``log_verbose_level``, ``log_format``); POST changes the ones it names
(``null`` or an unknown name: left alone) and answers them all, as Triton does, with
Triton's error texts. Unlike Triton, a POST applies nothing unless every value is valid,
and wrong types and malformed bodies are 400s (Triton answers 500); an unknown format is
a 400 too (Triton: 503). ``log_format`` takes Triton's ``default`` and ``ISO8601``, and
Sluice's ``json``. A change applies to every gateway process of the deployment (the one
that answers at once, the others at their next catalog refresh: see
:mod:`sluice.gateway.control.log_settings`), not to the workers or ``sluice up``; the path is a
management one for the edge guard (admin keys).
"""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response

from sluice.core.errors import InvalidInput
from sluice.gateway.control.log_settings import change_log_settings, log_changes
from sluice.gateway.http.json_body import json_response
from sluice.gateway.state import state_of

logging_router = APIRouter()


@logging_router.get("/v2/logging")
async def log_settings(request: Request) -> Response:
    return json_response((await change_log_settings(state_of(request), {})).as_triton())


@logging_router.post("/v2/logging")
async def update_log_settings(request: Request) -> Response:
    changes = parse_log_settings(await request.body())
    return json_response((await change_log_settings(state_of(request), changes)).as_triton())


def parse_log_settings(body: bytes) -> dict[str, Any]:
    """The changes a POST body asks for, as
    :meth:`sluice.core.observability.logs.LogControl.update`'s arguments; checked in Triton's order,
    so the first error is the one Triton reports."""
    try:
        document = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise InvalidInput(f"failed to parse the request JSON buffer: {exc}") from None
    if not isinstance(document, dict):
        raise InvalidInput("failed to parse the request JSON buffer: not a JSON object")
    return log_changes(document)
