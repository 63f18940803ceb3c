"""Request ids, JSON logs and traces on a real stack (``sluice up``), exporting spans to an
OTLP/HTTP receiver run by the test.

What a client sees (``X-Request-ID``, ``traceparent``), what the processes log (one JSON
object per line, with the request's id in the gateway's and in the worker's lines), and
what reaches the collector: the ``receive``, ``queue_wait``, ``batch_compute`` and
``reply`` spans of one request, in the trace of the client's ``traceparent``.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from sluice.scheduler.executor.redis_server import RedisServer
from tests.support.model_files import write_fragile
from tests.support.onnx_models import write_identity
from tests.support.otlp_receiver import OtlpReceiver, ReceivedSpan
from tests.support.stack import Stack

KINDS = {"receive", "queue_wait", "batch_compute", "reply"}
TRACEPARENT = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")
LOG_FIELDS = {"time", "level", "logger", "message", "role", "pid"}
OK_BODY = {"inputs": [{"name": "IN_FP32", "shape": [1, 3], "datatype": "FP32", "data": [1, 2, 3]}]}


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    receiver = OtlpReceiver().start()
    yield receiver
    receiver.stop()


@pytest.fixture(scope="module")
def traced(
    tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer, receiver: OtlpReceiver
) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("traces")
    write_identity(root, "ident", ["FP32"])
    write_fragile(root)
    env = {
        "SLUICE_LOG_FORMAT": "json",
        "SLUICE_OTLP_ENDPOINT": receiver.endpoint,
        "OTEL_BSP_SCHEDULE_DELAY": "100",  # ms: spans reach the receiver quickly
        "SLUICE_BATCH_WORKERS": "1",  # its lines are JSON too
    }
    stack = Stack(root, redis_server.url, env=env)
    stack.start()
    yield stack
    stack.stop()


@pytest.fixture(scope="module")
def http(traced: Stack) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=traced.url, timeout=60) as client:
        yield client


def new_traceparent() -> tuple[str, str, str]:
    trace_id, parent_id = uuid.uuid4().hex, uuid.uuid4().hex[:16]
    return f"00-{trace_id}-{parent_id}-01", trace_id, parent_id


def of_trace(spans: list[ReceivedSpan], trace_id: str) -> dict[str, ReceivedSpan]:
    return {span.name: span for span in spans if span.trace_id == trace_id}


def json_lines(stack: Stack) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stack.stderr_lines if line.startswith("{")]


def test_four_spans_share_the_clients_trace(http: httpx.Client, receiver: OtlpReceiver) -> None:
    traceparent, trace_id, parent_id = new_traceparent()
    response = http.post(
        "/v2/models/ident/infer", json=OK_BODY, headers={"traceparent": traceparent}
    )
    assert response.status_code == 200
    answered = TRACEPARENT.fullmatch(response.headers["traceparent"])
    assert answered is not None
    assert answered.group(1) == trace_id and answered.group(3) == "01"
    spans = of_trace(receiver.wait_for(lambda s: set(of_trace(s, trace_id)) >= KINDS), trace_id)
    assert set(spans) >= KINDS, spans
    receive, wait = spans["receive"], spans["queue_wait"]
    compute, reply = spans["batch_compute"], spans["reply"]
    assert receive.parent_span_id == parent_id  # the client's span
    assert receive.span_id == answered.group(2)  # the response names the gateway's span
    assert wait.parent_span_id == receive.span_id
    assert reply.parent_span_id == receive.span_id
    assert compute.parent_span_id == receive.span_id
    assert (trace_id, receive.span_id) in compute.links
    assert wait.start_ns <= wait.end_ns == compute.start_ns <= compute.end_ns
    assert receive.start_ns <= wait.start_ns and reply.end_ns <= receive.end_ns
    assert {receive.resource["sluice.role"], reply.resource["sluice.role"]} == {"gateway"}
    assert {wait.resource["sluice.role"], compute.resource["sluice.role"]} == {"worker"}
    assert receive.attributes["sluice.request_id"] == response.headers["x-request-id"]
    assert receive.attributes["http.response.status_code"] == 200
    assert compute.attributes["sluice.model"] == "ident"


def test_an_invalid_traceparent_starts_a_new_trace(
    http: httpx.Client, receiver: OtlpReceiver
) -> None:
    _, trace_id, parent_id = new_traceparent()
    invalid = f"00-{trace_id.upper()}-{parent_id}-01"  # the specification's hex is lowercase
    response = http.post("/v2/models/ident/infer", json=OK_BODY, headers={"traceparent": invalid})
    assert response.status_code == 200
    answered = TRACEPARENT.fullmatch(response.headers["traceparent"])
    assert answered is not None and answered.group(1) != trace_id.lower()
    new_trace = answered.group(1)
    spans = of_trace(receiver.wait_for(lambda s: set(of_trace(s, new_trace)) >= KINDS), new_trace)
    assert set(spans) >= KINDS
    assert spans["receive"].parent_span_id == ""  # a root: nothing of the invalid header
    assert not [s for s in receiver.spans if s.trace_id == trace_id.lower()]


def test_a_failing_request_is_logged_with_its_id_by_gateway_and_worker(
    traced: Stack, http: httpx.Client, receiver: OtlpReceiver
) -> None:
    request_id = f"req-{uuid.uuid4().hex}"
    traceparent, trace_id, _ = new_traceparent()
    marker = -98765.25  # tensor data: must appear in no log line
    bad = {"inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [marker, 1]}]}
    response = http.post(
        "/v2/models/fragile/infer",
        json=bad,
        headers={"X-Request-ID": request_id, "traceparent": traceparent},
    )
    assert response.status_code == 500
    assert "negative input" in response.json()["error"]
    assert response.headers["x-request-id"] == request_id

    def ours(role: str) -> list[dict[str, Any]]:
        return [
            line
            for line in json_lines(traced)
            if line["role"] == role and line.get("request_id") == request_id
        ]

    spans = of_trace(receiver.wait_for(lambda s: set(of_trace(s, trace_id)) >= KINDS), trace_id)
    gateway, worker = ours("gateway"), ours("worker")
    assert gateway and worker, traced.stderr_lines[-20:]
    for line in (*gateway, *worker):
        assert line["level"] == "WARNING" and "negative input" in line["message"]
        assert line["trace_id"] == trace_id
        assert set(line) >= LOG_FIELDS
    assert worker[0]["logger"] == "sluice.workers.replies"
    assert str(marker) not in "".join(traced.stderr_lines)
    assert spans["receive"].status_code == 2  # a 500 marks the gateway's span as failed
    assert spans["batch_compute"].status_code == 2


def test_every_process_logs_json_lines(traced: Stack) -> None:
    lines = [line for line in traced.stderr_lines if line.strip()]
    assert lines
    documents = [json.loads(line) for line in lines]  # every line is one JSON object
    assert all(set(document) >= LOG_FIELDS for document in documents)
    assert {"up", "gateway", "worker", "batch"} <= {document["role"] for document in documents}


def test_the_request_id_is_the_kserve_id_then_the_header_then_a_new_one(
    http: httpx.Client,
) -> None:
    with_id = dict(OK_BODY, id="kserve-7")
    response = http.post("/v2/models/ident/infer", json=with_id, headers={"X-Request-ID": "h-1"})
    assert response.headers["x-request-id"] == "kserve-7" == response.json()["id"]
    response = http.post("/v2/models/ident/infer", json=OK_BODY, headers={"X-Request-ID": "h-2"})
    assert response.headers["x-request-id"] == "h-2"
    made_up = {
        http.post("/v2/models/ident/infer", json=OK_BODY).headers["x-request-id"] for _ in range(3)
    }
    assert len(made_up) == 3 and "" not in made_up
    refused = http.post("/v2/models/nosuch/infer", json=OK_BODY, headers={"X-Request-ID": "h-3"})
    assert refused.status_code == 404 and refused.headers["x-request-id"] == "h-3"
    unusable = http.post(
        "/v2/models/ident/infer",
        json=dict(OK_BODY, id="line\nbreak"),
        headers={"X-Request-ID": "h-4"},
    )
    assert unusable.headers["x-request-id"] == "h-4"  # an id that is no header value
    assert unusable.json()["id"] == "line\nbreak"


def test_a_grpc_call_is_a_span_of_its_own(traced: Stack, receiver: OtlpReceiver) -> None:
    """ModelInfer's ``receive`` span: a child of the client's ``traceparent`` metadata, the
    parent of the request's other spans, with the RPC and its status code; a call the model
    fails is a failed span, a model that does not exist is the client's error."""
    traceparent, trace_id, parent_id = new_traceparent()
    failing, failing_trace, _ = new_traceparent()
    unknown, unknown_trace, _ = new_traceparent()
    with grpcclient.InferenceServerClient(traced.grpc_address) as client:
        values = grpcclient.InferInput("IN_FP32", [1, 3], "FP32")
        values.set_data_from_numpy(np.array([[1, 2, 3]], dtype=np.float32))
        result = client.infer(
            "ident", [values], request_id="grpc-ok", headers={"traceparent": traceparent}
        )
        assert result.as_numpy("OUT_FP32").tolist() == [[1, 2, 3]]
        negative = grpcclient.InferInput("x", [1, 2], "FP32")
        negative.set_data_from_numpy(np.array([[-1, 1]], dtype=np.float32))
        with pytest.raises(InferenceServerException, match="negative input"):
            client.infer("fragile", [negative], headers={"traceparent": failing})
        with pytest.raises(InferenceServerException) as missing:
            client.infer("no_such_model", [values], headers={"traceparent": unknown})
        assert missing.value.status() == "StatusCode.NOT_FOUND"

    spans = of_trace(receiver.wait_for(lambda s: set(of_trace(s, trace_id)) >= KINDS), trace_id)
    receive = spans["receive"]
    assert receive.parent_span_id == parent_id
    assert receive.attributes["rpc.system"] == "grpc"
    assert receive.attributes["rpc.service"] == "inference.GRPCInferenceService"
    assert receive.attributes["rpc.method"] == "ModelInfer"
    assert receive.attributes["rpc.grpc.status_code"] == 0
    assert receive.attributes["sluice.request_id"] == "grpc-ok"
    assert receive.status_code != 2
    for kind in ("queue_wait", "reply", "batch_compute"):
        assert spans[kind].parent_span_id == receive.span_id, kind

    failed = receiver.wait_for(lambda s: "receive" in of_trace(s, failing_trace))
    failed_receive = of_trace(failed, failing_trace)["receive"]
    assert failed_receive.attributes["rpc.grpc.status_code"] == 13  # INTERNAL
    assert failed_receive.status_code == 2
    absent = receiver.wait_for(lambda s: "receive" in of_trace(s, unknown_trace))
    absent_receive = of_trace(absent, unknown_trace)["receive"]
    assert absent_receive.attributes["rpc.grpc.status_code"] == 5  # NOT_FOUND
    assert absent_receive.status_code != 2
