"""Python models that call other models (Triton's BLS) on a real stack: a Triton-style
model with ``InferenceRequest(...).exec()`` and ``async_exec()``, a model in Sluice's own
API with ``context.infer``, the called model's error as a response error, and a BLS model
as a step of an ensemble."""

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
    assert response.status_code == 500
    assert "no_such_model" in response.json()["error"]


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
