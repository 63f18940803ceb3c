"""Python models that call other models (Triton's BLS) on a real stack: a Triton-style
model with ``InferenceRequest(...).exec()`` and ``async_exec()``, a model in Sluice's own
API with ``context.infer``, the called model's error as a response error, a BLS model
as a step of an ensemble, and BLS calls of a decoupled model (``exec(decoupled=True)``)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from sluice.scheduler.executor.redis_server import RedisServer
from tests.support.stack import Stack

ROOT = Path(__file__).resolve().parents[2]

IO = """
max_batch_size: 8
input [ { name: "X" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ 4 ] } ]
"""

TRITON_BLS = """
import asyncio

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    async def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            if float(x.reshape(-1)[0]) < 0:
                call = pb_utils.InferenceRequest(
                    model_name="no_such_model",
                    requested_output_names=["OUTPUT0"],
                    inputs=[pb_utils.Tensor("INPUT0", x)],
                )
                answer = call.exec()
                responses.append(pb_utils.InferenceResponse(error=answer.error()))
                continue
            ones = np.ones_like(x)
            first = pb_utils.InferenceRequest(
                model_name="add_sub",
                requested_output_names=["OUTPUT0"],
                inputs=[pb_utils.Tensor("INPUT0", x), pb_utils.Tensor("INPUT1", ones)],
            ).exec()
            assert not first.has_error(), first.error().message()
            total = pb_utils.get_output_tensor_by_name(first, "OUTPUT0").as_numpy()
            # Two calls at once: (x + 1) + x and (x + 1) - x.
            both = await asyncio.gather(
                *(
                    pb_utils.InferenceRequest(
                        model_name="add_sub",
                        requested_output_names=[],
                        inputs=[pb_utils.Tensor("INPUT0", total), pb_utils.Tensor("INPUT1", x)],
                    ).async_exec()
                    for _ in range(2)
                )
            )
            plus = pb_utils.get_output_tensor_by_name(both[0], "OUTPUT0").as_numpy()
            minus = pb_utils.get_output_tensor_by_name(both[1], "OUTPUT1").as_numpy()
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", plus * minus)]))
        return responses
"""

SLUICE_BLS = """
class Model:
    def initialize(self, config, context):
        self.context = context

    def execute(self, inputs):
        x = inputs["X"]
        answer = self.context.infer("add_sub", {"INPUT0": x, "INPUT1": x}, ["OUTPUT0"])
        return {"Y": answer["OUTPUT0"] * 10}
"""

ENSEMBLE = """
name: "bls_pipeline"
platform: "ensemble"
max_batch_size: 8
input [ { name: "IN" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 4 ] } ]
ensemble_scheduling {
  step [
    { model_name: "bls_sluice" model_version: -1
      input_map { key: "X" value: "IN" } output_map { key: "Y" value: "middle" } },
    { model_name: "bls_triton" model_version: -1
      input_map { key: "X" value: "middle" } output_map { key: "Y" value: "OUT" } }
  ]
}
"""


STEPS = """
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            n = pb_utils.get_input_tensor_by_name(request, "N").as_numpy()
            delay = pb_utils.get_input_tensor_by_name(request, "DELAY_MS").as_numpy()
            sender = request.get_response_sender()
            for step in range(int(n.reshape(-1)[0])):
                if sender.is_cancelled():
                    break
                time.sleep(float(delay.reshape(-1)[0]) / 1000)
                step_tensor = pb_utils.Tensor("STEP", np.array([step], dtype=np.int32))
                sender.send(pb_utils.InferenceResponse([step_tensor]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""

STEPS_CONFIG = """
name: "steps"
backend: "python"
max_batch_size: 0
input [
  { name: "N" data_type: TYPE_INT32 dims: [ 1 ] },
  { name: "DELAY_MS" data_type: TYPE_INT32 dims: [ 1 ] }
]
output [ { name: "STEP" data_type: TYPE_INT32 dims: [ 1 ] } ]
model_transaction_policy { decoupled: true }
"""

BLS_STREAM = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    async def execute(self, requests):
        responses = []
        for request in requests:
            n, stop, delay = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()[0]
            call = pb_utils.InferenceRequest(
                model_name="steps",
                requested_output_names=["STEP"],
                inputs=[
                    pb_utils.Tensor("N", np.array([n], dtype=np.int32)),
                    pb_utils.Tensor("DELAY_MS", np.array([delay], dtype=np.int32)),
                ],
            )
            stream = await call.async_exec(decoupled=True) if not stop else call.exec(True)
            total = count = cancelled = empty = 0
            for response in stream:
                if response.has_error():
                    cancelled = int(response.error().code() == pb_utils.TritonError.CANCELLED)
                    break
                if not response.output_tensors():
                    empty += 1
                    continue
                total += int(pb_utils.get_output_tensor_by_name(response, "STEP").as_numpy()[0])
                count += 1
                if count == stop:
                    stream.cancel()
            out = np.array([[total, count, cancelled, empty]], dtype=np.int32)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", out)]))
        return responses
"""

BLS_STREAM_CONFIG = """
name: "bls_stream"
backend: "python"
max_batch_size: 8
input [ { name: "X" data_type: TYPE_INT32 dims: [ 3 ] } ]
output [ { name: "Y" data_type: TYPE_INT32 dims: [ 4 ] } ]
"""


def _python_model(root: Path, name: str, source: str) -> None:
    (root / name / "1").mkdir(parents=True)
    (root / name / "1" / "model.py").write_text(source)
    (root / name / "config.pbtxt").write_text(f'name: "{name}"\nbackend: "python"\n' + IO)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("bls")
    shutil.copytree(ROOT / "model_repository" / "triton_python_add_sub", root / "add_sub")
    config = root / "add_sub" / "config.pbtxt"
    config.write_text(config.read_text().replace('"triton_python_add_sub"', '"add_sub"'))
    _python_model(root, "bls_triton", TRITON_BLS)
    _python_model(root, "bls_sluice", SLUICE_BLS)
    (root / "bls_pipeline" / "1").mkdir(parents=True)
    (root / "bls_pipeline" / "config.pbtxt").write_text(ENSEMBLE)
    for name, source, config in (
        ("steps", STEPS, STEPS_CONFIG),
        ("bls_stream", BLS_STREAM, BLS_STREAM_CONFIG),
    ):
        (root / name / "1").mkdir(parents=True)
        (root / name / "1" / "model.py").write_text(source)
        (root / name / "config.pbtxt").write_text(config)
    stack = Stack(root, redis_server.url)
    stack.start()
    yield stack
    stack.stop()


def _infer(stack: Stack, model: str, rows: np.ndarray, name: str = "X") -> httpx.Response:
    body: dict[str, Any] = {
        "inputs": [
            {
                "name": name,
                "shape": list(rows.shape),
                "datatype": "FP32",
                "data": rows.ravel().tolist(),
            }
        ]
    }
    return httpx.post(f"{stack.url}/v2/models/{model}/infer", json=body, timeout=60)


def _triton_bls(x: np.ndarray) -> np.ndarray:
    total = x + 1
    return (total + x) * (total - x)


def test_a_triton_model_calls_another_with_exec_and_async_exec(stack: Stack) -> None:
    rows = np.arange(8, dtype=np.float32).reshape(2, 4)
    response = _infer(stack, "bls_triton", rows)
    assert response.status_code == 200, response.text
    output = response.json()["outputs"][0]
    np.testing.assert_allclose(np.reshape(output["data"], output["shape"]), _triton_bls(rows))


def test_many_clients_at_once(stack: Stack) -> None:
    def one(seed: int) -> bool:
        rows = np.random.default_rng(seed).uniform(0, 5, (1, 4)).astype(np.float32)
        output = _infer(stack, "bls_triton", rows).json()["outputs"][0]
        return np.allclose(np.reshape(output["data"], output["shape"]), _triton_bls(rows))

    with ThreadPoolExecutor(16) as pool:
        assert all(pool.map(one, range(48)))


def test_the_called_models_error_is_the_answers_error(stack: Stack) -> None:
    response = _infer(stack, "bls_triton", -np.ones((1, 4), dtype=np.float32))
    # The called model's status too: the BLS response's error keeps its code.
    assert response.status_code == 404
    assert response.json()["error"] == "Request for unknown model: 'no_such_model' is not found"


def test_a_sluice_model_calls_another_with_its_context(stack: Stack) -> None:
    rows = np.arange(4, dtype=np.float32).reshape(1, 4)
    response = _infer(stack, "bls_sluice", rows)
    assert response.status_code == 200, response.text
    assert response.json()["outputs"][0]["data"] == (rows * 2 * 10).ravel().tolist()


def test_bls_models_as_steps_of_an_ensemble(stack: Stack) -> None:
    rows = np.full((1, 4), 0.5, dtype=np.float32)
    response = _infer(stack, "bls_pipeline", rows, name="IN")
    assert response.status_code == 200, response.text
    expected = _triton_bls(rows * 2 * 10)
    np.testing.assert_allclose(response.json()["outputs"][0]["data"], expected.ravel())


def _bls_stream(stack: Stack, n: int, stop: int, delay_ms: int) -> list[int]:
    body = {
        "inputs": [{"name": "X", "shape": [1, 3], "datatype": "INT32", "data": [n, stop, delay_ms]}]
    }
    response = httpx.post(f"{stack.url}/v2/models/bls_stream/infer", json=body, timeout=60)
    assert response.status_code == 200, response.text
    data: list[int] = response.json()["outputs"][0]["data"]
    return data


def test_a_bls_call_of_a_decoupled_model_iterates_its_responses(stack: Stack) -> None:
    """``await async_exec(decoupled=True)``: every response in order, then the empty final
    one (the called model sends its final flag alone), as Triton's iterator gives them."""
    total, count, cancelled, empty = _bls_stream(stack, 5, 0, 0)
    assert (total, count, cancelled, empty) == (0 + 1 + 2 + 3 + 4, 5, 0, 1)


def test_a_bls_stream_cancelled_midway_ends_with_a_cancelled_error(stack: Stack) -> None:
    """``exec(True)`` then ``cancel()`` after two of fifty slow responses: the iterator ends
    with a CANCELLED error long before the fifty (the call is withdrawn as a client's
    cancelled stream is: tests/integration/test_cancellation.py)."""
    total, count, cancelled, empty = _bls_stream(stack, 50, 2, 100)
    assert cancelled == 1 and 2 <= count < 50 and empty == 0, (total, count, cancelled, empty)
