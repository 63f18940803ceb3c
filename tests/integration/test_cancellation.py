"""Requests whose callers went away are not computed.

A model holds its only instance with one request (asleep until the test lets it go: no
CPU is spent while the others wait); a thousand HTTP clients queue requests behind it and
disconnect; none of them is computed (the model's execution count), the queue is
empty again, Triton's ``CANCELED`` failure counts them, and the model's next request is
answered as if they never came. A cancelled gRPC call is withdrawn the same way.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
import pytest
import redis
import tritonclient.grpc as grpcclient

from tests.support.gate_model import BLOCKER_ITERS, open_gate, write_gate, write_wrapper
from tests.support.load import marker, slow_request
from tests.support.stack import Stack

CLIENTS = 1000
GENERATE_CLIENTS = 10
"""Of them, clients of the generate route (a FastAPI route, not the inference fast path)."""


def _stats(stack: Stack) -> dict[str, Any]:
    with httpx.Client(base_url=stack.url, timeout=30) as http:
        response = http.get("/v2/models/slow/stats")
    assert response.status_code == 200, response.text
    stats: dict[str, Any] = response.json()["model_stats"][0]
    return stats


def _canceled_failures(stack: Stack) -> float:
    with httpx.Client(base_url=stack.url, timeout=30) as http:
        text = http.get("/metrics").text
    for line in text.splitlines():
        failure = line.startswith("nv_inference_request_failure{")
        if failure and 'reason="CANCELED"' in line and 'model="slow"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _queued(client: redis.Redis, stream_prefix: str) -> int:
    return sum(
        int(client.xlen(key)) for key in client.scan_iter(match=f"{stream_prefix}*", _type="stream")
    )


def _computing(client: redis.Redis, stack: Stack) -> bool:
    """Whether the worker took a request (the blocker) from the queue."""
    stream = f"{stack.namespace}:req:{{slow}}:1"
    if not client.exists(stream):
        return False
    pending: dict[str, Any] = client.xpending(stream, "workers")
    return int(pending["pending"]) >= 1


@dataclass
class SlowStack:
    """A stack serving ``slow``, a gate model (tests.support.gate_model), and what the tests
    read of it."""

    stack: Stack
    client: redis.Redis
    gate: Path
    executions: int
    """The model's execution count at the start."""

    def release(self) -> None:
        """Let the blocker (and every later blocker) through."""
        open_gate(self.gate, "slow")


def _slow_stack(
    repository: Path, start_stack: Callable[..., Stack], env: dict[str, str] | None = None
) -> SlowStack:
    write_gate(repository, "slow")
    gate = repository.parent / f"{repository.name}-gate"
    gate.mkdir()
    stack = start_stack(repository, env={**(env or {}), "SLUICE_TEST_GATE": str(gate)})
    assert stack.redis_url is not None
    client = redis.Redis.from_url(stack.redis_url)
    return SlowStack(stack, client, gate, _stats(stack)["execution_count"])


def _block(slow: SlowStack) -> dict[str, Any]:
    """Occupy the only instance with one request over HTTP until :meth:`SlowStack.release`;
    returns once the worker took it. The dict gets the answer's ``status`` and ``text``,
    then ``done`` (an Event) is set."""
    stack = slow.stack
    blocker: dict[str, Any] = {"done": threading.Event()}

    def block() -> None:
        with httpx.Client(base_url=stack.url, timeout=300) as http:
            response = http.post(
                "/v2/models/slow/infer", content=orjson.dumps(slow_request(1, BLOCKER_ITERS))
            )
        blocker["status"], blocker["text"] = response.status_code, response.text
        blocker["done"].set()

    threading.Thread(target=block, daemon=True).start()
    _wait_until_computing(slow)
    return blocker


def _wait_until_computing(slow: SlowStack) -> None:
    deadline = time.monotonic() + 60
    while not _computing(slow.client, slow.stack):
        assert time.monotonic() < deadline, "the blocker never started"
        time.sleep(0.05)


def _request_bytes(stack: Stack, index: int) -> bytes:
    if index % (CLIENTS // GENERATE_CLIENTS) == 0:
        path = "/v2/models/slow/generate"
        body = orjson.dumps({"IN": marker(index), "ITERS": [1]})
    else:
        path = "/v2/models/slow/infer"
        body = orjson.dumps(slow_request(index, 1))
    host = stack.url.split("//", 1)[1]
    head = (
        f"POST {path} HTTP/1.1\r\nhost: {host}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


def test_disconnected_clients_are_not_computed(
    tmp_path: Path, start_stack: Callable[..., Stack]
) -> None:
    slow = _slow_stack(tmp_path, start_stack)
    stack, client, before = slow.stack, slow.client, slow.executions
    # One long request occupies the only instance while the others queue behind it.
    blocker = _block(slow)
    host, port = stack.url.split("//", 1)[1].rsplit(":", 1)
    sockets: list[socket.socket] = []
    deadline = time.monotonic() + 60
    try:
        for index in range(CLIENTS):
            connection = socket.create_connection((host, int(port)), timeout=30)
            connection.sendall(_request_bytes(stack, index))
            sockets.append(connection)
        # Every request is queued (or held by the worker for its next batch)...
        while _queued(client, f"{stack.namespace}:req:{{slow}}") < CLIENTS:
            assert time.monotonic() < deadline, "the requests never reached the queue"
            time.sleep(0.05)
    finally:
        # ... when its client goes away.
        for connection in sockets:
            connection.close()
    while _queued(client, f"{stack.namespace}:req:{{slow}}") > 1:
        assert time.monotonic() < deadline, "the cancelled requests stayed queued"
        time.sleep(0.05)
    slow.release()
    assert blocker["done"].wait(300)
    assert blocker.get("status") == 200, blocker

    # The next request is answered at once, and with its own data.
    with httpx.Client(base_url=stack.url, timeout=60) as http:
        response = http.post("/v2/models/slow/infer", content=orjson.dumps(slow_request(7, 1)))
    assert response.status_code == 200, response.text
    output = response.json()["outputs"][0]["data"]
    assert np.allclose(output, marker(7))

    stats = _stats(stack)
    assert stats["execution_count"] == before + 2  # the blocker and the last request only
    deadline = time.monotonic() + 30
    while _canceled_failures(stack) < CLIENTS:
        assert time.monotonic() < deadline, f"CANCELED failures: {_canceled_failures(stack)}"
        time.sleep(0.2)
    assert _canceled_failures(stack) == CLIENTS
    with httpx.Client(base_url=stack.url, timeout=30) as http:
        metrics = http.get("/metrics").text
    assert f'sluice_tenant_cancelled_total{{tenant="anonymous"}} {CLIENTS}.0' in metrics


def test_a_cancelled_grpc_call_is_withdrawn(
    tmp_path: Path, start_stack: Callable[..., Stack]
) -> None:
    slow = _slow_stack(tmp_path, start_stack)
    stack, before = slow.stack, slow.executions
    grpc = grpcclient.InferenceServerClient(stack.grpc_address)

    def inputs(index: int, iters: int) -> list[grpcclient.InferInput]:
        data = grpcclient.InferInput("IN", [1, 4], "FP32")
        data.set_data_from_numpy(np.array([marker(index)], dtype=np.float32))
        rounds = grpcclient.InferInput("ITERS", [1, 1], "INT64")
        rounds.set_data_from_numpy(np.array([[iters]], dtype=np.int64))
        return [data, rounds]

    results: list[Any] = []
    blocked = threading.Event()
    blocker = grpc.async_infer(
        "slow", inputs(1, BLOCKER_ITERS), callback=lambda result, error: blocked.set()
    )
    _wait_until_computing(slow)
    calls = [
        grpc.async_infer(
            "slow", inputs(10 + i, 1), callback=lambda result, error: results.append(error)
        )
        for i in range(20)
    ]
    # Queued behind the blocker (the worker holds the blocker's entry) before they go.
    stream = f"{stack.namespace}:req:{{slow}}:1"
    deadline = time.monotonic() + 60
    while int(slow.client.xlen(stream)) < 21:
        assert time.monotonic() < deadline, "the calls never reached the queue"
        time.sleep(0.05)
    for call in calls:
        call.cancel()
    # A call whose deadline passes while it waits is withdrawn too (the client's deadline,
    # or the server's answer to it: whichever comes first on a busy machine).
    with pytest.raises(Exception, match=r"(?i)deadline"):
        grpc.infer("slow", inputs(99, 1), client_timeout=0.5)
    slow.release()
    assert blocked.wait(300)
    del blocker
    answer = grpc.infer("slow", inputs(7, 1))
    assert np.allclose(answer.as_numpy("OUT"), [marker(7)])
    assert _stats(stack)["execution_count"] == before + 2
    grpc.close()


def test_an_ensembles_steps_are_withdrawn_with_it(
    tmp_path: Path, start_stack: Callable[..., Stack]
) -> None:
    """The client of an ensemble request goes away while its step waits behind another
    request: the step is withdrawn from the composing model's queue, never computed."""
    write_wrapper(tmp_path, "wrapped", "slow")
    slow = _slow_stack(tmp_path, start_stack)
    stack, client, before = slow.stack, slow.client, slow.executions
    blocker = _block(slow)
    deadline = time.monotonic() + 60
    host, port = stack.url.split("//", 1)[1].rsplit(":", 1)
    connection = socket.create_connection((host, int(port)), timeout=30)
    body = orjson.dumps(slow_request(5, 1))
    connection.sendall(
        b"POST /v2/models/wrapped/infer HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        + f"content-length: {len(body)}\r\n\r\n".encode()
        + body
    )
    stream = f"{stack.namespace}:req:{{slow}}:1"
    while int(client.xlen(stream)) < 2:
        assert time.monotonic() < deadline, "the ensemble's step never reached its model"
        time.sleep(0.05)
    connection.close()
    while int(client.xlen(stream)) > 1:
        assert time.monotonic() < deadline, "the step stayed queued"
        time.sleep(0.05)
    slow.release()
    assert blocker["done"].wait(300)
    assert _stats(stack)["execution_count"] == before + 1  # the blocker alone


MARKING = """
import os
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils

MARKS = os.environ["SLUICE_TEST_MARKS"]


def mark(what):
    with open(os.path.join(MARKS, what), "w") as file:
        file.write(what)
"""
"""What the test models share: a mark left in SLUICE_TEST_MARKS says what they saw."""

WAITER = (
    MARKING
    + """

class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            if float(x.reshape(-1)[0]) < 0:  # one BLS call to the slow model
                mark("calling")
                call = pb_utils.InferenceRequest(
                    model_name="slow",
                    requested_output_names=["OUT"],
                    inputs=[
                        pb_utils.Tensor("IN", x.astype(np.float32)),
                        pb_utils.Tensor("ITERS", np.ones((x.shape[0], 1), dtype=np.int64)),
                    ],
                )
                answer = call.exec()
                mark("withdrawn" if answer.has_error() else "answered")
                responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", x)]))
                continue
            mark("waiting")
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not request.is_cancelled():
                time.sleep(0.01)
            mark("cancelled" if request.is_cancelled() else "not-cancelled")
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", x)]))
        return responses
"""
)

WAITER_CONFIG = """name: "waiter"
backend: "python"
max_batch_size: 1
input [ { name: "IN" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 4 ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]
"""


TICKER = (
    MARKING
    + """

class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            threading.Thread(target=self.tick, args=(request,), daemon=True).start()
        return None

    def tick(self, request):
        sender = request.get_response_sender()
        x = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not sender.is_cancelled():
            sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", x)]))
            time.sleep(0.05)
        mark("stream-cancelled" if request.is_cancelled() else "stream-not-cancelled")
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
"""
)

TICKER_CONFIG = """name: "ticker"
backend: "python"
max_batch_size: 1
input [ { name: "IN" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 4 ] } ]
model_transaction_policy { decoupled: true }
"""


def _send_and_keep(stack: Stack, model: str, value: float) -> socket.socket:
    host, port = stack.url.split("//", 1)[1].rsplit(":", 1)
    connection = socket.create_connection((host, int(port)), timeout=30)
    body = orjson.dumps(
        {"inputs": [{"name": "IN", "shape": [1, 4], "datatype": "FP32", "data": [value] * 4}]}
    )
    connection.sendall(
        f"POST /v2/models/{model}/infer HTTP/1.1\r\nhost: x\r\n"
        f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n".encode()
        + body
    )
    return connection


def _wait_for(path: Path, what: str) -> None:
    deadline = time.monotonic() + 60
    while not path.exists():
        assert time.monotonic() < deadline, f"no '{path.name}' mark: {what}"
        time.sleep(0.05)


def test_python_models_see_cancellation_and_their_bls_calls_are_withdrawn(
    tmp_path: Path, start_stack: Callable[..., Stack]
) -> None:
    repository, marks = tmp_path / "repository", tmp_path / "marks"
    marks.mkdir()
    (repository / "waiter" / "1").mkdir(parents=True)
    (repository / "waiter" / "1" / "model.py").write_text(WAITER)
    (repository / "waiter" / "config.pbtxt").write_text(WAITER_CONFIG)
    (repository / "ticker" / "1").mkdir(parents=True)
    (repository / "ticker" / "1" / "model.py").write_text(TICKER)
    (repository / "ticker" / "config.pbtxt").write_text(TICKER_CONFIG)
    slow = _slow_stack(repository, start_stack, env={"SLUICE_TEST_MARKS": str(marks)})
    stack, client, before = slow.stack, slow.client, slow.executions

    # request.is_cancelled() turns True once the client goes away.
    connection = _send_and_keep(stack, "waiter", 1.0)
    _wait_for(marks / "waiting", "the request never reached execute")
    connection.close()
    _wait_for(marks / "cancelled", "is_cancelled() never turned True")

    # A BLS call waiting behind another request is withdrawn with its caller.
    blocker = _block(slow)
    deadline = time.monotonic() + 60
    connection = _send_and_keep(stack, "waiter", -1.0)
    _wait_for(marks / "calling", "the BLS call was never made")
    stream = f"{stack.namespace}:req:{{slow}}:1"
    while int(client.xlen(stream)) < 2:
        assert time.monotonic() < deadline, "the BLS call never reached its model"
        time.sleep(0.05)
    connection.close()
    _wait_for(marks / "withdrawn", "the BLS call was not withdrawn")
    # (Its entry leaves the stream just after: the withdrawal does not wait for Redis.)
    while int(client.xlen(stream)) > 1:
        assert time.monotonic() < deadline, "the BLS call's entry stayed queued"
        time.sleep(0.05)
    slow.release()
    assert blocker["done"].wait(300)
    assert _stats(stack)["execution_count"] == before + 1  # the blocker alone

    # A decoupled model streaming its responses sees its gRPC stream cancelled (through
    # its response sender and its request).
    responses: list[Any] = []
    grpc = grpcclient.InferenceServerClient(stack.grpc_address)
    try:
        grpc.start_stream(callback=lambda result, error: responses.append((result, error)))
        data = grpcclient.InferInput("IN", [1, 4], "FP32")
        data.set_data_from_numpy(np.ones((1, 4), dtype=np.float32))
        grpc.async_stream_infer("ticker", [data])
        deadline = time.monotonic() + 60
        while len(responses) < 2:
            assert time.monotonic() < deadline, f"the stream never answered: {responses}"
            time.sleep(0.05)
        assert all(error is None for _, error in responses), responses
        grpc.stop_stream(cancel_requests=True)
    finally:
        grpc.close()
    _wait_for(marks / "stream-cancelled", "is_cancelled() never turned True in a stream")
