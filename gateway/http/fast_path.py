"""The inference route as a plain ASGI handler.

Profiles showed the framework's routing, dependency and middleware layers
costing more CPU per request than the request's own work, so
``POST /v2/models/{m}[/versions/{v} | /labels/{l}]/infer`` is served here directly; every
other route goes to the FastAPI application, which also owns the lifespan. It is the only
HTTP handler of inference: the FastAPI schema describes these routes without handling them
(:mod:`sluice.gateway.http.schema`); validation, queueing and encoding are the data plane's
(:mod:`sluice.gateway.inference.data_plane`), shared with gRPC, jobs, generate and
TorchServe's routes.

Every answer carries the request's id as ``X-Request-ID`` (see
:mod:`sluice.gateway.inference.request_id`). A valid W3C ``traceparent`` travels on to the
worker in the stream entry; with tracing on (an OTLP endpoint configured, see
:mod:`sluice.core.observability.tracing`; set up by the lifespan) the request gets a
``receive`` span, whose context goes to the worker instead and back to the client as
``traceparent``.
"""

from __future__ import annotations

import asyncio
import logging
import re

import orjson
from fastapi import FastAPI
from starlette.types import Message, Receive, Scope, Send

from sluice.core.errors import Overloaded, SluiceError
from sluice.core.observability.logs import TRACE_ID
from sluice.core.observability.trace_context import TraceParent, parse_traceparent
from sluice.core.routing import requested_label
from sluice.gateway.body_budget import BodyReservation
from sluice.gateway.control.catalog_follow import follow_changes
from sluice.gateway.http.body import (
    check_declared_length,
    decoded_body,
    parse_header_length,
    too_large,
)
from sluice.gateway.http.compression import accepted, compressed
from sluice.gateway.http.guard import tenant_of
from sluice.gateway.http.protocol import CANCEL_ON_DISCONNECT, DISCONNECTED, cancel_on_disconnect
from sluice.gateway.inference import request_id
from sluice.gateway.inference.data_plane import refuse_early, run_infer
from sluice.gateway.inference.response import encode_error
from sluice.gateway.jobs.async_jobs import job_record, prefers_async, status_body, submit_job
from sluice.gateway.state import GatewayState

log = logging.getLogger(__name__)

EARLY_REFUSAL_BYTES = 64 * 1024
"""A request with a body at least this large is checked against its tenant's limits and
its model's queue before the body is read
(:func:`~sluice.gateway.inference.data_plane.refuse_early`)."""

_INFER_PATH = re.compile(r"^/v2/models/([^/]+)(?:/versions/([^/]+)|/labels/([^/]+))?/infer$")
_JSON = (b"content-type", b"application/json")
_BINARY = (b"content-type", b"application/octet-stream")
_ALLOW_POST = (b"allow", b"POST")
_WANTED = frozenset(
    (
        b"content-length",
        b"content-encoding",
        b"inference-header-content-length",
        b"x-request-id",
        b"traceparent",
        b"tracestate",
        b"sluice-version-label",
        b"prefer",
        b"idempotency-key",
        b"authorization",
        b"accept-encoding",
    )
)


class InferFastPath:
    def __init__(self, app: FastAPI) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state: GatewayState = self.app.state.sluice
        match = _INFER_PATH.match(scope["path"])
        if match is None:
            # (an inference catches up in the data plane, whatever its transport)
            if state.host_changes.value() != state.host_seen:
                await follow_changes(state)  # a change through another gateway process
            try:
                await self.app(scope, receive, send)
            except asyncio.CancelledError:
                if not scope.get(DISCONNECTED):
                    raise
                # A route's client went away while it waited (cancel_on_disconnect).
            return
        if scope["method"] != "POST":
            await _respond(send, 405, encode_error("Method Not Allowed"), [_JSON, _ALLOW_POST])
            return
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
        headers = _headers(scope)
        request_id.from_header(headers.get(b"x-request-id"))
        trace = _incoming_trace(headers)
        tracing = state.tracing
        span = tracing.receive(match.group(1), trace) if tracing is not None else None
        if span is not None:
            trace = span.context
        if trace is not None:
            TRACE_ID.set(trace.trace_id)
        error = ""
        unread = True
        try:
            limit = state.settings.max_body_bytes
            declared = check_declared_length(headers.get(b"content-length"), limit) or 0
            version, label = match.group(2), match.group(3)
            if declared >= EARLY_REFUSAL_BYTES:
                refuse_early(state, match.group(1), version, label)
            reservation.ensure(declared)
            body = await _read(receive, limit, reservation)
            unread = False
            encoding = headers.get(b"content-encoding")
            if encoding is not None:  # (a large one is inflated in a worker thread)
                body = await decoded_body(body, encoding, limit)
                reservation.ensure(len(body))
            json_length = parse_header_length(headers.get(b"inference-header-content-length"))
            label = requested_label(version, label, headers.get(b"sluice-version-label"))
            if prefers_async(headers.get(b"prefer")):
                status, content, response_headers = await _submit_job(
                    state,
                    match.group(1),
                    version,
                    body,
                    json_length,
                    label,
                    trace,
                    headers,
                    tenant_of(scope),
                )
            else:
                cancel_on_disconnect(scope)
                try:
                    content, response_json_length = await run_infer(
                        state, match.group(1), version, body, json_length, trace, span, label
                    )
                finally:
                    scope.pop(CANCEL_ON_DISCONNECT, None)
                status = 200
                if response_json_length is None:
                    response_headers = [_JSON]
                else:
                    length = str(response_json_length).encode()
                    response_headers = [_BINARY, (b"inference-header-content-length", length)]
                content, encoding = await compressed(
                    content, accepted(headers.get(b"accept-encoding"))
                )
                if encoding is not None:
                    response_headers.append((b"content-encoding", encoding.encode()))
        except ClientDisconnected:
            if span is not None:
                span.end(0, request_id.current(), "the client went away")
            return
        except asyncio.CancelledError:
            if not scope.get(DISCONNECTED):
                raise
            # The client went away while its request waited: the request was taken back
            # from the queue (sluice.core.cancellation); there is nobody to answer.
            if span is not None:
                span.end(0, request_id.current(), "the client went away")
            log.debug("the client of request %s went away; cancelled", request_id.current())
            return
        except SluiceError as exc:
            status, error = int(exc.status), exc.message
            content, response_headers = encode_error(error), [_JSON]
            if isinstance(exc, Overloaded) and exc.retry_after_s is not None:
                response_headers.append((b"retry-after", str(exc.retry_after_s).encode()))
            if unread:  # (refused before its body was read: the connection cannot go on)
                response_headers.append((b"connection", b"close"))
            # A model's failure is worth a warning; refusals are the client's (or load's).
            level = logging.WARNING if status == 500 else logging.DEBUG
            request_id.current()  # (made up now if need be, so the line carries it)
            log.log(level, "inference request failed: %d %s", status, error)
        except Exception as exc:
            request_id.current()
            log.exception("inference request failed")
            status, error = 500, f"internal error: {type(exc).__name__}: {exc}"
            content, response_headers = encode_error(error), [_JSON]
        rid = request_id.current()
        response_headers.append((b"x-request-id", rid.encode()))
        if span is not None:
            response_headers.append((b"traceparent", span.context.header.encode()))
        try:
            await _respond(send, status, content, response_headers)
        finally:
            if span is not None:
                span.end(status, rid, error)


async def _submit_job(
    state: GatewayState,
    model: str,
    version: str | None,
    body: bytes,
    json_length: int | None,
    label: str | None,
    trace: TraceParent | None,
    headers: dict[bytes, str],
    tenant: str,
) -> tuple[int, bytes, list[tuple[bytes, bytes]]]:
    """``Prefer: respond-async``: 202, the job's status and its URL in ``Location``."""
    submitted = await submit_job(
        state,
        model,
        version,
        body,
        json_length,
        label=label,
        trace=trace,
        idempotency_key=headers.get(b"idempotency-key"),
        owner=tenant,
    )
    if submitted.status is not None:
        body = orjson.dumps(submitted.status)
    else:  # an earlier job with the same idempotency key: as it is now
        record = await job_record(state, submitted.job_id, tenant)
        body = status_body(submitted.job_id, record)
    location = f"/v2/jobs/{submitted.job_id}".encode()
    return 202, body, [_JSON, (b"location", location), (b"preference-applied", b"respond-async")]


class ClientDisconnected(Exception):
    """The client went away (or was cut off as too slow) before its body was complete."""


def _headers(scope: Scope) -> dict[bytes, str]:
    return {name: value.decode("latin-1") for name, value in scope["headers"] if name in _WANTED}


def _incoming_trace(headers: dict[bytes, str]) -> TraceParent | None:
    """The client's trace context; None without one, or with an invalid one."""
    traceparent = headers.get(b"traceparent")
    if traceparent is None:
        return None
    return parse_traceparent(traceparent, headers.get(b"tracestate"))


async def _read(receive: Receive, limit: int, reservation: BodyReservation) -> bytes:
    """The whole body, within ``limit`` and the process's body budget (``reservation``)."""
    message: Message = await receive()
    body = message.get("body", b"")
    if not message.get("more_body", False):
        if len(body) > limit:
            raise too_large(limit)
        reservation.ensure(len(body))
        return bytes(body)
    # The parts as uvicorn delivered them, joined once at the end: one copy of the body on
    # the event loop, where growing a buffer part by part copied it about three times.
    parts = [body]
    size = len(body)
    while message.get("more_body", False):
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnected()
        part = message.get("body", b"")
        parts.append(part)
        size += len(part)
        if size > limit:
            raise too_large(limit)
        reservation.ensure(size)
    return b"".join(parts)


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
