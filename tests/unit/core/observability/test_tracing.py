"""W3C trace context (sluice.core.observability.trace_context), span construction
(sluice.core.observability.otel) with the SDK's in-memory exporter, the trace context in the
stream entry, and that nothing of OpenTelemetry's tracing SDK is imported while tracing is
off."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from sluice.core.observability.otel import Tracing
from sluice.core.observability.trace_context import TraceParent, parse_traceparent, valid_tracestate
from sluice.core.observability.tracing import traces_endpoint, tracing_from_settings
from sluice.core.settings import CommonSettings
from sluice.core.wire import HEADER_FIELD, RequestMessage, decode_request, encode_request

TRACE = "0af7651916cd43dd8448eb211c80319c"
PARENT = "b7ad6b7169203331"
VALID = f"00-{TRACE}-{PARENT}-01"


@pytest.fixture
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture
def tracing(exporter: InMemorySpanExporter) -> Iterator[Tracing]:
    provider = TracerProvider(shutdown_on_exit=False)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing = Tracing(provider)
    yield tracing
    tracing.shutdown()


def by_name(exporter: InMemorySpanExporter) -> dict[str, list[ReadableSpan]]:
    spans: dict[str, list[ReadableSpan]] = {}
    for span in exporter.get_finished_spans():
        spans.setdefault(span.name, []).append(span)
    return spans


def hex_ids(span: ReadableSpan) -> tuple[str, str, str]:
    """(trace id, span id, parent span id or "") in hex."""
    context = span.get_span_context()
    assert context is not None
    parent = f"{span.parent.span_id:016x}" if span.parent is not None else ""
    return f"{context.trace_id:032x}", f"{context.span_id:016x}", parent


# -- traceparent / tracestate ------------------------------------------------------------


def test_a_valid_traceparent() -> None:
    parent = parse_traceparent(VALID, "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7")
    assert parent == TraceParent(TRACE, PARENT, "01", "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7")
    assert parent.header == VALID and parent.sampled
    assert not TraceParent(TRACE, PARENT, "00").sampled


@pytest.mark.parametrize(
    "value",
    [
        "",
        f"00-{TRACE.upper()}-{PARENT}-01",  # hex must be lowercase
        f"00-{'0' * 32}-{PARENT}-01",  # all-zero trace id
        f"00-{TRACE}-{'0' * 16}-01",  # all-zero parent id
        f"ff-{TRACE}-{PARENT}-01",  # version ff is invalid
        f"00-{TRACE}-{PARENT}-01-extra",  # version 00 has exactly four fields
        f"00-{TRACE}-{PARENT}-1",
        f"00-{TRACE[:-1]}-{PARENT}-01",
        f"00-{TRACE}-{PARENT}0-01",
        f"00_{TRACE}_{PARENT}_01",
        f"0-{TRACE}-{PARENT}-01",
        f"00-{TRACE}-{PARENT[:-1]}g-01",
        f" 00-{TRACE}-{PARENT}-01",
        f"01-{TRACE}-{PARENT}-01x",  # a later version's extra fields follow a "-"
    ],
)
def test_invalid_traceparents_are_ignored(value: str) -> None:
    assert parse_traceparent(value, "a=b") is None


def test_a_later_version_is_read_as_version_00() -> None:
    parent = parse_traceparent(f"cc-{TRACE}-{PARENT}-01-what-comes-next")
    assert parent is not None and parent.header == VALID


@pytest.mark.parametrize(
    ("value", "valid"),
    [
        ("", True),
        ("rojo=00f067aa0ba902b7", True),
        ("rojo=00f067aa0ba902b7 , ,congo=t61rcWkgMzE", True),
        ("tenant1@vendor=value", True),
        ("a=" + "v" * 256, True),
        ("a=" + "v" * 257, False),
        ("Upper=x", False),
        ("a=b=c", False),  # "=" is no value character
        ("a=", False),
        ("a=spaces inside ", True),  # the last space is the list's optional whitespace
        ("a=tab\tinside", False),
        ("a=1,a=2", False),
        ("novalue", False),
        (",".join(f"k{i}=v" for i in range(33)), False),
        ("x=" + "y" * 200 + ",z=" + "y" * 200 + ",w=" + "y" * 200, False),  # over 512
    ],
)
def test_tracestate(value: str, valid: bool) -> None:
    assert valid_tracestate(value) is valid
    parent = parse_traceparent(VALID, value)
    assert parent is not None and parent.state == (value if valid else "")


# -- spans -------------------------------------------------------------------------------


def test_receive_and_reply_continue_the_clients_trace(
    tracing: Tracing, exporter: InMemorySpanExporter
) -> None:
    parent = parse_traceparent(VALID, "rojo=00f067aa0ba902b7")
    span = tracing.receive("iris", parent)
    assert span.context.trace_id == TRACE and span.context.parent_id != PARENT
    assert span.context.flags == "01" and span.context.state == "rojo=00f067aa0ba902b7"
    span.reply().end()
    span.end(200, "req-1")
    spans = by_name(exporter)
    [receive], [reply] = spans["receive"], spans["reply"]
    assert hex_ids(receive) == (TRACE, span.context.parent_id, PARENT)
    assert receive.kind == SpanKind.SERVER
    assert receive.attributes == {
        "sluice.model": "iris",
        "sluice.request_id": "req-1",
        "http.response.status_code": 200,
    }
    assert receive.status.status_code == StatusCode.UNSET
    assert receive.get_span_context().trace_state.to_header() == "rojo=00f067aa0ba902b7"
    assert hex_ids(reply)[0] == TRACE and hex_ids(reply)[2] == span.context.parent_id


def test_server_errors_mark_the_span_and_client_errors_do_not(
    tracing: Tracing, exporter: InMemorySpanExporter
) -> None:
    tracing.receive("m", None).end(404, "a", "unknown model")
    tracing.receive("m", None).end(500, "b", "the model raised")
    tracing.receive("m", None).end(0, "c", "the client went away")
    reply = tracing.receive("m", None).reply()
    reply.end("InferenceFailed")
    spans = {span.attributes["sluice.request_id"]: span for span in by_name(exporter)["receive"]}
    assert spans["a"].status.status_code == StatusCode.UNSET
    assert spans["b"].status.status_code == StatusCode.ERROR
    assert spans["b"].status.description == "the model raised"
    assert spans["c"].status.status_code == StatusCode.ERROR
    assert "http.response.status_code" not in spans["c"].attributes
    [failed_reply] = by_name(exporter)["reply"]
    assert failed_reply.status.status_code == StatusCode.ERROR


def test_without_a_parent_a_new_trace_starts(
    tracing: Tracing, exporter: InMemorySpanExporter
) -> None:
    first, second = tracing.receive("m", None), tracing.receive("m", None)
    assert first.context.trace_id != second.context.trace_id
    assert parse_traceparent(first.context.header) == first.context
    first.end(200, "x")
    [receive] = by_name(exporter)["receive"]
    assert receive.parent is None


def test_an_unsampled_parent_records_nothing_but_still_answers_a_traceparent(
    tracing: Tracing, exporter: InMemorySpanExporter
) -> None:
    span = tracing.receive("m", TraceParent(TRACE, PARENT, "00"))
    span.reply().end()
    span.end(200, "x")
    assert span.context.trace_id == TRACE and span.context.flags == "00"
    assert exporter.get_finished_spans() == ()


def test_a_batch_records_queue_waits_and_one_compute_span_linked_to_every_request(
    tracing: Tracing, exporter: InMemorySpanExporter
) -> None:
    other_trace, other_parent = "1" * 32, "2" * 16
    requests = [
        (TraceParent(TRACE, PARENT, "01"), "r1", 1_000),
        (None, "r2", 2_000),
        (TraceParent(other_trace, other_parent, "01"), "r3", 3_000),
    ]
    batch = tracing.batch("iris", 2, requests, started_ns=5_000)
    batch.end("RuntimeError: boom")
    spans = by_name(exporter)
    waits = {span.attributes["sluice.request_id"]: span for span in spans["queue_wait"]}
    assert (waits["r1"].start_time, waits["r1"].end_time) == (1_000, 5_000)
    assert (waits["r3"].start_time, waits["r3"].end_time) == (3_000, 5_000)
    assert hex_ids(waits["r1"])[::2] == (TRACE, PARENT)
    assert hex_ids(waits["r3"])[::2] == (other_trace, other_parent)
    assert waits["r2"].parent is None  # no trace context: a trace of its own
    [compute] = spans["batch_compute"]
    assert hex_ids(compute)[::2] == (TRACE, PARENT)  # the first request's tree
    linked = {
        (f"{link.context.trace_id:032x}", f"{link.context.span_id:016x}") for link in compute.links
    }
    assert linked == {(TRACE, PARENT), (other_trace, other_parent)}
    assert compute.start_time == 5_000 and compute.end_time is not None
    assert compute.status.status_code == StatusCode.ERROR
    assert compute.attributes["sluice.batch.request_ids"] == ("r1", "r2", "r3")
    assert compute.attributes["sluice.model_version"] == 2


def test_a_batch_of_untraced_requests_is_a_trace_of_its_own(
    tracing: Tracing, exporter: InMemorySpanExporter
) -> None:
    tracing.batch("m", 1, [(None, "a", 0)], started_ns=10).end()
    [compute] = by_name(exporter)["batch_compute"]
    assert compute.parent is None and compute.links == ()
    [wait] = by_name(exporter)["queue_wait"]
    assert wait.start_time == wait.end_time == 10  # no enqueue time: no wait to show


# -- the stream entry --------------------------------------------------------------------


def test_the_trace_context_travels_in_the_entry() -> None:
    trace = TraceParent(TRACE, PARENT, "01", "rojo=1")
    message = RequestMessage("1", "r", [], ["y"], request_id="q", trace=trace)
    decoded, _ = decode_request(encode_request(message, b""))
    assert decoded == message
    untraced = encode_request(RequestMessage("1", "r", [], ["y"]), b"")
    assert decode_request(untraced)[0].trace is None


def test_a_bad_trace_context_in_an_entry_is_dropped_not_the_request() -> None:
    import msgpack

    fields = encode_request(RequestMessage("1", "r", [], ["y"]), b"")
    header = msgpack.unpackb(fields[HEADER_FIELD])
    header["tp"], header["ts"] = f"00-{TRACE.upper()}-{PARENT}-01", "rojo=1"
    fields[HEADER_FIELD] = msgpack.packb(header)
    assert decode_request(fields)[0].trace is None
    header["tp"], header["ts"] = VALID, "not a tracestate"
    fields[HEADER_FIELD] = msgpack.packb(header)
    assert decode_request(fields)[0].trace == TraceParent(TRACE, PARENT, "01")


# -- configuration -----------------------------------------------------------------------


def test_the_endpoint_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SLUICE_OTLP_ENDPOINT", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    assert traces_endpoint(CommonSettings()) == ""
    assert tracing_from_settings(CommonSettings(), "gateway") is None
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318/")
    assert traces_endpoint(CommonSettings()) == "http://collector:4318/v1/traces"
    monkeypatch.setenv("SLUICE_OTLP_ENDPOINT", "http://mine:4318")
    assert traces_endpoint(CommonSettings()) == "http://mine:4318/v1/traces"


def test_an_exporting_tracer_names_its_service_and_role(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLUICE_OTLP_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "inference")
    tracing = tracing_from_settings(CommonSettings(), "worker")
    assert tracing is not None
    try:
        attributes = tracing.provider.resource.attributes
        assert attributes["service.name"] == "inference"
        assert attributes["sluice.role"] == "worker"
    finally:
        tracing.shutdown()  # nothing recorded: nothing sent


@pytest.mark.slow
def test_nothing_of_the_tracing_sdk_is_imported_while_tracing_is_off() -> None:
    """(redis-py imports the SDK's metrics part by itself when it is installed.)"""
    code = (
        "import sys\n"
        "import sluice.gateway.__main__, sluice.gateway.app, sluice.gateway.http.fast_path\n"
        "import sluice.workers.__main__, sluice.cli\n"
        "from sluice.core.settings import CommonSettings\n"
        "from sluice.core.observability.tracing import tracing_from_settings\n"
        "assert tracing_from_settings(CommonSettings(), 'gateway') is None\n"
        "loaded = [m for m in sys.modules if m.startswith(('opentelemetry.sdk.trace',"
        " 'opentelemetry.exporter', 'sluice.core.observability.otel'))]\n"
        "print(loaded)\n"
    )
    env = {"PATH": "/usr/bin:/bin"}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    )
    assert result.stdout.strip() == "[]", result.stdout + result.stderr
