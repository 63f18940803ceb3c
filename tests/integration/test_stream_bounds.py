"""What a streaming client leaves the server to hold or compute is bounded. A
ModelStreamInfer client that sends and never reads its answers: the stream reads no further
requests while its answers wait, and a decoupled model's responses pile up only to the
dispatcher's backlog, past which the request ends with an error and the model is told that
its request was cancelled. A stream cancelled while a decoupled model in Sluice's own API
streams to it stops that model's generator."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest
from tritonclient.grpc import service_pb2

from tests.support import procs
from tests.support.stack import Stack

STREAM = "/inference.GRPCInferenceService/ModelStreamInfer"
IN_FLIGHT = 4
"""SLUICE_GRPC_STREAM_MAX_IN_FLIGHT of the stack."""
SENT = 300

BIG = """
import numpy as np


class Model:
    def execute(self, inputs):
        return {"OUT": np.zeros((inputs["IN"].shape[0], 65536), dtype=np.float32)}
"""

BIG_CONFIG = """name: "big"
backend: "python"
max_batch_size: 8
input [ { name: "IN" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 65536 ] } ]
"""
"""256 KiB answers to requests of a few bytes."""

GUSHER = """
import os
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            threading.Thread(target=self.gush, args=(request,), daemon=True).start()
        return None

    def gush(self, request):
        sender = request.get_response_sender()
        chunk = np.zeros((1, 2048), dtype=np.float32)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not sender.is_cancelled():
            sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", chunk)]))
        what = "cancelled" if sender.is_cancelled() else "not-cancelled"
        with open(os.path.join(os.environ["SLUICE_TEST_MARKS"], what), "w") as file:
            file.write(what)
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
"""

GUSHER_CONFIG = """name: "gusher"
backend: "python"
max_batch_size: 1
input [ { name: "IN" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 2048 ] } ]
model_transaction_policy { decoupled: true }
"""
"""A decoupled model that sends 8 KiB responses as fast as it can until cancelled."""

TALKER = """
import os
import time

import numpy as np


class Model:
    def stream(self, inputs):
        count = int(inputs["IN"].reshape(-1)[0])
        step = 0
        try:
            while count < 0 or step < count:
                yield {"OUT": np.full((1, 1), step, dtype=np.float32)}
                step += 1
                time.sleep(0.01)
        finally:
            if count < 0:
                with open(os.path.join(os.environ["SLUICE_TEST_MARKS"], "stopped"), "w") as file:
                    file.write(str(step))
"""

TALKER_CONFIG = """name: "talker"
backend: "python"
max_batch_size: 1
input [ { name: "IN" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 1 ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]
model_transaction_policy { decoupled: true }
"""
"""A decoupled model in Sluice's API: IN responses, or endless ones for a negative IN."""


@pytest.fixture(scope="module")
def marks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("marks")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, marks: Path) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("stream_backpressure")
    for name, model, config in (
        ("big", BIG, BIG_CONFIG),
        ("gusher", GUSHER, GUSHER_CONFIG),
        ("talker", TALKER, TALKER_CONFIG),
    ):
        (root / name / "1").mkdir(parents=True)
        (root / name / "1" / "model.py").write_text(model)
        (root / name / "config.pbtxt").write_text(config)
    env = {
        "SLUICE_GRPC_STREAM_MAX_IN_FLIGHT": str(IN_FLIGHT),
        "SLUICE_TEST_MARKS": str(marks),
        "SLUICE_DEFAULT_TIMEOUT_S": "600",
    }
    stack = Stack(root, None, env=env, args=["--gateway-processes", "1"])
    stack.start()
    yield stack
    stack.stop()


def request(model: str, request_id: str, value: float = 1.0) -> bytes:
    message = service_pb2.ModelInferRequest(model_name=model, id=request_id)
    message.inputs.add(name="IN", datatype="FP32", shape=[1, 1])
    message.raw_input_contents.append(np.array([value], dtype=np.float32).tobytes())
    return bytes(message.SerializeToString())


def inferences(stack: Stack, model: str) -> int:
    stats = httpx.get(f"{stack.url}/v2/models/{model}/stats", timeout=10).json()
    return int(stats["model_stats"][0]["inference_count"])


def test_a_stream_that_reads_nothing_is_not_read_further(stack: Stack) -> None:
    """300 requests of 256 KiB answers sent, none read: the gateway computes the few that
    the stream's places and the transport's windows hold, then reads no more (it read them
    all and held every answer)."""
    with grpc.insecure_channel(stack.grpc_address) as channel:
        call = channel.stream_stream(STREAM)(iter([request("big", str(n)) for n in range(SENT)]))
        try:
            assert procs.wait_until(lambda: inferences(stack, "big") > 0, 60)
            time.sleep(5)  # (time to read and compute the rest, were it read)
            computed = inferences(stack, "big")
            assert computed < SENT // 4, f"{computed} of {SENT} requests were read and computed"
            # Reading the answers lets the stream go on to the end.
            assert sum(1 for _ in call) == SENT
        finally:
            call.cancel()


def test_a_decoupled_model_far_ahead_of_its_reader_is_stopped(stack: Stack, marks: Path) -> None:
    """The gusher streams to a client that reads nothing: once its responses fill the
    request's backlog the request ends, and the model sees it cancelled (it went on sending
    for as long as its deadline, into a queue that grew without bound)."""
    with grpc.insecure_channel(stack.grpc_address) as channel:
        call = channel.stream_stream(STREAM)(iter([request("gusher", "g")]))
        try:
            assert procs.wait_until(lambda: (marks / "cancelled").exists(), 120), (
                "the model was never told to stop"
            )
            errors = [
                answer.error_message
                for raw in call
                if (answer := service_pb2.ModelStreamInferResponse.FromString(raw)).error_message
            ]
        except grpc.RpcError as exc:
            pytest.fail(f"the stream failed: {exc}")
        finally:
            call.cancel()
    assert (
        len(errors) == 1
        and "responses waited for a client that reads them too slowly" in (errors[0])
    ), errors


def test_a_cancelled_stream_stops_a_decoupled_models_generator(stack: Stack, marks: Path) -> None:
    """The talker streams without end until its stream is cancelled: its generator is
    closed (it ran on, and held its only instance for good), and the instance serves the
    next request."""
    with grpc.insecure_channel(stack.grpc_address) as channel:
        call = channel.stream_stream(STREAM)(iter([request("talker", "endless", -1.0)]))
        for _, raw in zip(range(3), call, strict=False):
            assert not service_pb2.ModelStreamInferResponse.FromString(raw).error_message
        call.cancel()
    assert procs.wait_until(lambda: (marks / "stopped").exists(), 30), "the generator ran on"
    with grpc.insecure_channel(stack.grpc_address) as channel:
        call = channel.stream_stream(STREAM)(iter([request("talker", "next", 2.0)]))
        answers = [service_pb2.ModelStreamInferResponse.FromString(raw) for raw in call]
    assert [a.error_message for a in answers] == ["", ""]
    assert [a.infer_response.id for a in answers] == ["next", "next"]
