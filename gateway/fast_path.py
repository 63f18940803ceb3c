"""The inference route as a plain ASGI handler.

Profiles showed the framework's routing, dependency and middleware layers
costing more CPU per request than the request's own work, so
``POST /v2/models/{m}[/versions/{v}]/infer`` is served here directly; every
other route goes to the FastAPI application, which also owns the lifespan.
"""

from __future__ import annotations

import asyncio
import logging
import re

from fastapi import FastAPI
from starlette.types import Message, Receive, Scope, Send

from gateway.body import check_declared_length, decode_body, parse_header_length, too_large
from gateway.body_budget import BodyReservation
from gateway.infer import run_infer
from gateway.infer_response import encode_error
from gateway.state import GatewayState
from sluice.errors import Overloaded, SluiceError

log = logging.getLogger(__name__)

_INFER_PATH = re.compile(r"^/v2/models/([^/]+)(?:/versions/([^/]+))?/infer$")
_JSON = (b"content-type", b"application/json")
_BINARY = (b"content-type", b"application/octet-stream")


class InferFastPath:
    def __init__(self, app: FastAPI) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        match = _INFER_PATH.match(scope["path"])
        if match is None:
            await self.app(scope, receive, send)
            return
        state: GatewayState = self.app.state.sluice
        reservation = state.bodies.reservation()
        try:
            await self._infer(state, match, scope, receive, send, reservation)
        finally:
            reservation.release()

    async def _infer(
        self,
        state: GatewayState,
        match: re.Match[str],
        scope: Scope,
        receive: Receive,
        send: Send,
        reservation: BodyReservation,
    ) -> None:
        try:
            headers = _headers(scope)
            limit = state.settings.max_body_bytes
            reservation.ensure(check_declared_length(headers.get(b"content-length"), limit) or 0)
            body = await _read(receive, limit, reservation)
            encoding = headers.get(b"content-encoding")
            if encoding is not None:  # decompressing may take long: not on the event loop
                body = await asyncio.to_thread(decode_body, body, encoding, limit)
                reservation.ensure(len(body))
            json_length = parse_header_length(headers.get(b"inference-header-content-length"))
            content, response_json_length = await run_infer(
                state, match.group(1), match.group(2), body, json_length
            )
        except ClientDisconnected:
            return
        except SluiceError as exc:
            extra = (
                [(b"retry-after", str(exc.retry_after_s).encode())]
                if isinstance(exc, Overloaded)
                else []
            )
            await _respond(send, int(exc.status), encode_error(exc.message), [_JSON, *extra])
            return
        except Exception as exc:
            log.exception("inference request failed")
            await _respond(
                send, 500, encode_error(f"internal error: {type(exc).__name__}: {exc}"), [_JSON]
            )
            return
        if response_json_length is None:
            await _respond(send, 200, content, [_JSON])
        else:
            length_header = (b"inference-header-content-length", str(response_json_length).encode())
            await _respond(send, 200, content, [_BINARY, length_header])


class ClientDisconnected(Exception):
    """The client went away (or was cut off as too slow) before its body was complete."""


def _headers(scope: Scope) -> dict[bytes, str]:
    wanted = (b"content-length", b"content-encoding", b"inference-header-content-length")
    return {name: value.decode("latin-1") for name, value in scope["headers"] if name in wanted}


async def _read(receive: Receive, limit: int, reservation: BodyReservation) -> bytes:
    """The whole body, within ``limit`` and the process's body budget (``reservation``)."""
    message: Message = await receive()
    body = message.get("body", b"")
    if not message.get("more_body", False):
        if len(body) > limit:
            raise too_large(limit)
        reservation.ensure(len(body))
        return bytes(body)
    chunks = bytearray(body)
    while message.get("more_body", False):
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnected()
        chunks += message.get("body", b"")
        if len(chunks) > limit:
            raise too_large(limit)
        reservation.ensure(len(chunks))
    return bytes(chunks)


async def _respond(
    send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]]
) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [*headers, (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})
