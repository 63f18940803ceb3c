"""``GET`` / ``POST /v2/logging``: Triton's logging extension.

GET answers the settings under Triton's names (``log_file``, ``log_info``, ``log_warning``,
``log_error``, ``log_verbose_level``, ``log_format``); POST changes the ones it names
(``null`` or an unknown name: left alone) and answers them all, as Triton does, with
Triton's error texts. Unlike Triton, a POST applies nothing unless every value is valid,
and wrong types and malformed bodies are 400s (Triton answers 500); an unknown format is
a 400 too (Triton: 503). ``log_format`` takes Triton's ``default`` and ``ISO8601``, and
Sluice's ``json``. The settings are those of the gateway process that answers (see
:mod:`sluice.core.logs`); the path is a management one for the edge guard (admin keys).
"""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response

from sluice.core.errors import InvalidInput, Unsupported
from sluice.core.logs import FORMATS, control
from sluice.gateway.json_body import json_response

logging_router = APIRouter()

_BOOLEAN = "attempt to access JSON non-boolean as boolean"
_UNSIGNED = "attempt to access JSON non-unsigned-integer as unsigned-integer"
_STRING = "attempt to access JSON non-string as string"
_MAX_UINT64 = (1 << 64) - 1


@logging_router.get("/v2/logging")
async def log_settings() -> Response:
    return json_response(control().options.as_triton())


@logging_router.post("/v2/logging")
async def update_log_settings(request: Request) -> Response:
    changes = parse_log_settings(await request.body())
    return json_response(control().update(**changes).as_triton())


def parse_log_settings(body: bytes) -> dict[str, Any]:
    """The changes a POST body asks for, as :meth:`sluice.core.logs.LogControl.update`'s
    arguments; checked in Triton's order, so the first error is the one Triton reports."""
    try:
        document = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise InvalidInput(f"failed to parse the request JSON buffer: {exc}") from None
    if not isinstance(document, dict):
        raise InvalidInput("failed to parse the request JSON buffer: not a JSON object")
    return log_changes(document)


def log_changes(document: dict[str, Any]) -> dict[str, Any]:
    """The changes a settings document asks for (POST's body, or gRPC's settings)."""
    changes: dict[str, Any] = {}
    if document.get("log_file") is not None:
        raise Unsupported("log file location can not be updated through network protocol")
    for argument in ("info", "warning", "error"):
        value = document.get(f"log_{argument}")
        if value is not None:
            if not isinstance(value, bool):
                raise InvalidInput(_BOOLEAN)
            changes[argument] = value
    level = document.get("log_verbose_level")
    if level is not None:
        if isinstance(level, bool) or not isinstance(level, int) or not 0 <= level <= _MAX_UINT64:
            raise InvalidInput(_UNSIGNED)
        changes["verbose_level"] = level
    log_format = document.get("log_format")
    if log_format is not None:
        if not isinstance(log_format, str):
            raise InvalidInput(_STRING)
        if log_format not in FORMATS:
            raise InvalidInput(f"invalid argument for --log_format, got: {log_format}")
        changes["format"] = log_format
    return changes
