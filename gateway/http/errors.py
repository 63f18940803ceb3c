"""The gateway's error answers over HTTP: every failure reaches the client as
``{"error": ...}`` with its status (and ``Retry-After`` when the load refused it)."""

from __future__ import annotations

import logging

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from redis.exceptions import RedisError
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from sluice.core.errors import QUEUE_UNREACHABLE, Overloaded, PayloadTooLarge, SluiceError
from sluice.gateway.inference.response import encode_error

log = logging.getLogger(__name__)

CLOSE = {"Connection": "close"}
"""On an answer sent before the request's body was read: the server closes the connection
once it is sent, instead of waiting for (and discarding) a body it refused."""


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> Response:
    return Response(encode_error(message), status, headers=headers, media_type="application/json")


async def _sluice_error(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, SluiceError)
    headers = None
    if isinstance(exc, Overloaded) and exc.retry_after_s is not None:
        headers = {"Retry-After": str(exc.retry_after_s)}
    if isinstance(exc, PayloadTooLarge):
        headers = CLOSE  # the rest of the body is not read: the connection cannot go on
    return _error(int(exc.status), exc.message, headers)


async def _redis_error(_: Request, exc: Exception) -> Response:
    return _error(503, QUEUE_UNREACHABLE)


async def _http_error(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return _error(exc.status_code, str(exc.detail), getattr(exc, "headers", None))


async def _validation_error(_: Request, exc: Exception) -> Response:
    return _error(400, f"invalid request: {exc}")


async def _unexpected_error(_: Request, exc: Exception) -> Response:
    """Starlette answers plain text otherwise; clients always get ``{"error": ...}``."""
    log.error("request failed", exc_info=exc)
    return _error(500, f"internal error: {type(exc).__name__}")


def add_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(SluiceError, _sluice_error)
    app.add_exception_handler(RedisError, _redis_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(Exception, _unexpected_error)
