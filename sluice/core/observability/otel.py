"""OpenTelemetry spans of the request path (the ``tracing`` extra; imported only when
tracing is configured, see :mod:`sluice.core.observability.tracing`).

One request makes four kinds of span, all in the trace of the client's ``traceparent``
(or a new trace when it sent none, or an invalid one):

- ``receive`` (gateway, kind SERVER): from the request's arrival to its response; its
  context goes into the stream entry and, over HTTP, back to the client as
  ``traceparent``; a gRPC call's also names the RPC and its status code (OpenTelemetry's
  ``rpc.*`` attributes);
- ``queue_wait`` (worker): from the entry's enqueue time to the start of its batch,
  recorded with those explicit times, child of ``receive``;
- ``batch_compute`` (worker): the batch's computation, linked to the ``receive`` span of
  every request in the batch (its parent is the first request's, so a batch of one is
  one tree);
- ``reply`` (gateway): from the answer's arrival to its encoded response, child of
  ``receive``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import (
    Link,
    NonRecordingSpan,
    Span,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
    TraceState,
)

from sluice.core.observability.trace_context import TraceParent

QueuedRequest = tuple[TraceParent | None, str, int]
"""What the worker knows of a request in a batch: (trace context, request id, enqueued
at in Unix ns)."""


GRPC_SERVICE = "inference.GRPCInferenceService"

GRPC_SERVER_ERRORS = frozenset({2, 4, 12, 13, 14, 15})
"""The gRPC status codes that mark a server's span as failed (OpenTelemetry's conventions:
UNKNOWN, DEADLINE_EXCEEDED, UNIMPLEMENTED, INTERNAL, UNAVAILABLE, DATA_LOSS); the others
are the client's."""


def _context(parent: TraceParent | None) -> Context:
    """A context whose current span is the remote ``parent`` (empty: a new trace)."""
    if parent is None:
        return Context()
    span_context = SpanContext(
        trace_id=int(parent.trace_id, 16),
        span_id=int(parent.parent_id, 16),
        is_remote=True,
        trace_flags=TraceFlags(int(parent.flags, 16)),
        trace_state=TraceState.from_header([parent.state]) if parent.state else None,
    )
    return trace.set_span_in_context(NonRecordingSpan(span_context))


def _trace_parent(span: Span, state: str) -> TraceParent:
    context = span.get_span_context()
    return TraceParent(
        f"{context.trace_id:032x}", f"{context.span_id:016x}", f"{context.trace_flags:02x}", state
    )


def _end(span: Span, error: str, end_time: int | None = None) -> None:
    if error:
        span.set_status(Status(StatusCode.ERROR, error))
    span.end(end_time)


class ReplySpan:
    """``reply``: the gateway turning a worker's answer into the response."""

    __slots__ = ("_span",)

    def __init__(self, span: Span) -> None:
        self._span = span

    def end(self, error_kind: str = "") -> None:
        if error_kind:
            self._span.set_attribute("sluice.error_kind", error_kind)
        _end(self._span, error_kind)


class RequestSpan:
    """``receive``: one inference request in the gateway, arrival to response."""

    __slots__ = ("_span", "_tracer", "context")

    def __init__(self, tracer: trace.Tracer, span: Span, state: str) -> None:
        self._tracer = tracer
        self._span = span
        self.context = _trace_parent(span, state)
        """This span as a trace context: for the stream entry and the response header."""

    def reply(self) -> ReplySpan:
        context = trace.set_span_in_context(self._span)
        return ReplySpan(self._tracer.start_span("reply", context=context))

    def end(self, status: int, request_id: str, error: str = "") -> None:
        """``status``: the HTTP status answered, 0 for none (the client went away); a 5xx,
        or no answer, marks the span as failed with ``error``."""
        if status:
            self._span.set_attribute("http.response.status_code", status)
        self._span.set_attribute("sluice.request_id", request_id)
        _end(self._span, error if status >= 500 or not status else "")

    def end_call(self, code: int | None, request_id: str, error: str = "") -> None:
        """A gRPC call's: ``code``, the status code answered (0: OK), None for none (the
        client cancelled); a server's error code, or no answer, marks the span as failed
        with ``error``."""
        if code is not None:
            self._span.set_attribute("rpc.grpc.status_code", code)
        self._span.set_attribute("sluice.request_id", request_id)
        _end(self._span, error if code is None or code in GRPC_SERVER_ERRORS else "")


class BatchSpan:
    """``batch_compute``: one batch in a worker."""

    __slots__ = ("_span",)

    def __init__(self, span: Span) -> None:
        self._span = span

    def end(self, error: str = "") -> None:
        _end(self._span, error)


class Tracing:
    """Spans of one process, through ``provider`` (tests give one with an in-memory
    exporter; :meth:`exporting` builds the OTLP/HTTP one)."""

    def __init__(self, provider: TracerProvider) -> None:
        self.provider = provider
        self._tracer = provider.get_tracer("sluice")

    @classmethod
    def exporting(cls, endpoint: str, *, service_name: str, role: str) -> Tracing:
        """Spans batched on a background thread and sent to ``endpoint`` (OTLP/HTTP,
        protobuf). OTEL_BSP_* and OTEL_TRACES_SAMPLER are read by the SDK as usual."""
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        resource = Resource.create(
            {"service.name": service_name, "sluice.role": role, "process.pid": os.getpid()}
        )
        provider = TracerProvider(resource=resource)
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
        return cls(provider)

    def shutdown(self) -> None:
        """Export what is left and stop."""
        self.provider.shutdown()

    def receive(
        self, model: str, parent: TraceParent | None, *, rpc_method: str = ""
    ) -> RequestSpan:
        """Start the ``receive`` span of a request to ``model``, child of the client's
        ``parent`` (a new trace when None); the client's ``tracestate`` goes on with it.
        ``rpc_method``: the gRPC method of a call (``ModelInfer``, ``ModelStreamInfer``)."""
        attributes: dict[str, Any] = {"sluice.model": model}
        if rpc_method:
            attributes.update(
                {"rpc.system": "grpc", "rpc.service": GRPC_SERVICE, "rpc.method": rpc_method}
            )
        span = self._tracer.start_span(
            "receive", context=_context(parent), kind=SpanKind.SERVER, attributes=attributes
        )
        return RequestSpan(self._tracer, span, parent.state if parent is not None else "")

    def batch(
        self, model: str, version: int, requests: Sequence[QueuedRequest], started_ns: int
    ) -> BatchSpan:
        """Record each request's ``queue_wait`` (enqueue to ``started_ns``) and start the
        batch's ``batch_compute`` span, linked to every request's span."""
        links: list[Link] = []
        parent: Context | None = None
        for trace_parent, request_id, enqueued_ns in requests:
            context = _context(trace_parent)
            wait = self._tracer.start_span(
                "queue_wait",
                context=context,
                start_time=min(enqueued_ns, started_ns) if enqueued_ns else started_ns,
                attributes={"sluice.request_id": request_id},
            )
            wait.end(started_ns)
            if trace_parent is not None:
                links.append(Link(trace.get_current_span(context).get_span_context()))
                parent = parent or context
        attributes: dict[str, Any] = {
            "sluice.model": model,
            "sluice.model_version": version,
            "sluice.batch.requests": len(requests),
            "sluice.batch.request_ids": [request_id for _, request_id, _ in requests],
        }
        span = self._tracer.start_span(
            "batch_compute",
            context=parent or Context(),
            links=links,
            start_time=started_ns,
            attributes=attributes,
        )
        return BatchSpan(span)
