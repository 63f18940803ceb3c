"""Ragged batching for Python models, computed by the worker's execution as a batch of
stream entries: as in Triton, requests whose ``allow_ragged_batch`` input differs in shape
share one ``execute`` call, each ``InferenceRequest`` keeping its own tensors, and each
answer keeps its own output shape; without ``allow_ragged_batch`` they go in different
batches. A model of Sluice's own API (one array per input) runs once per group of
requests whose shapes agree. Batch inputs and outputs stay refused for Python models
(Triton's Python backend ignores them)."""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sluice.core.config import ModelConfig, parse_config_text
from sluice.core.datatypes import to_buffer
from sluice.core.errors import InvalidConfig
from sluice.core.placement import Placement
from sluice.core.repository import read_model
from sluice.core.wire import RequestMessage, TensorHeader
from sluice.workers.backends import load_backend
from sluice.workers.backends.base import Backend
from sluice.workers.execution import Execution
from sluice.workers.ragged import RaggedInputs, RaggedOutputs
from sluice.workers.replies import Timing
from sluice.workers.tensors import PendingRequest, combine, shape_key
from tests.support.model_files import python_config, tensor, write_model

RECORDING = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        shapes = [pb_utils.get_input_tensor_by_name(r, "X").as_numpy().shape for r in requests]
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            seen = np.array([[list(shape) for shape in shapes]] * x.shape[0], np.int32)
            responses.append(
                pb_utils.InferenceResponse(
                    [
                        pb_utils.Tensor("Y", x * 2),
                        pb_utils.Tensor("CALLS", np.full((x.shape[0], 1), len(requests), np.int32)),
                        pb_utils.Tensor("SHAPES", seen),
                    ]
                )
            )
        return responses
"""

WHOLE_ARRAYS = """
import numpy as np


class Model:
    calls = []

    def execute(self, inputs):
        x = inputs["X"]
        type(self).calls.append(x.shape)
        return {"Y": x * 2, "CALLS": np.full((x.shape[0], 1), len(type(self).calls), np.int32)}
"""

RAGGED_X = '{ name: "X" data_type: TYPE_FP32 dims: [ -1 ] allow_ragged_batch: true }'
OUTPUTS = [
    tensor("Y", "TYPE_FP32", "-1"),
    tensor("CALLS", "TYPE_INT32", "1"),
    tensor("SHAPES", "TYPE_INT32", "-1, 2"),
]
CPU = Placement("KIND_CPU", None, 1)
_ENTRIES = itertools.count(1)


def _load(root: Path, name: str, x: str, code: str) -> tuple[ModelConfig, Backend]:
    model_dir = write_model(root, name, python_config([x], OUTPUTS), {"1/model.py": code})
    found = read_model(model_dir)
    assert found.config is not None, found.error
    return found.config, load_backend(found.config, found.model_file(1), CPU)


@pytest.fixture
def recording(tmp_path: Path) -> Iterator[tuple[ModelConfig, Backend]]:
    config, backend = _load(tmp_path, "recording", RAGGED_X, RECORDING)
    yield config, backend
    backend.close()


def _request(config: ModelConfig, x: np.ndarray, outputs: list[str]) -> PendingRequest:
    data = to_buffer("FP32", x)
    message = RequestMessage(
        request_key=uuid.uuid4().hex,
        reply_to="",
        inputs=[TensorHeader("X", "FP32", tuple(x.shape), len(data))],
        outputs=outputs,
    )
    entry_id = f"{next(_ENTRIES)}-0".encode()
    request = PendingRequest(entry_id, message, memoryview(bytes(data)), x.shape[0], ())
    request.key = shape_key(message, config)
    return request


def _answer(answer: Any) -> dict[str, np.ndarray]:
    """An answer's outputs by name (FP32 ``Y``, INT32 the others)."""
    headers, payload = answer
    arrays: dict[str, np.ndarray] = {}
    offset = 0
    for header in headers:
        dtype = np.float32 if header.datatype == "FP32" else np.int32
        chunk = payload[offset : offset + header.nbytes]
        arrays[header.name] = np.frombuffer(chunk, dtype).reshape(header.shape)
        offset += header.nbytes
    return arrays


def _rows(lengths: list[int]) -> list[np.ndarray]:
    return [np.arange(n, dtype=np.float32).reshape(1, n) + 10 * n for n in lengths]


def test_requests_of_different_shapes_reach_one_execute_each_with_its_own_tensors(
    recording: tuple[ModelConfig, Backend],
) -> None:
    config, backend = recording
    assert config.ragged_inputs == frozenset({"X"})
    xs = [*_rows([3, 4]), np.ones((2, 5), np.float32)]  # (the last: 2 batch items)
    batch = [_request(config, x, ["Y", "CALLS", "SHAPES"]) for x in xs]
    assert len({r.key for r in batch}) == 1  # (one batch, whatever the lengths)
    inputs = combine(batch, config)
    assert isinstance(inputs, RaggedInputs) and "X" not in inputs
    assert [part.shape for part in inputs.parts["X"]] == [(1, 3), (1, 4), (2, 5)]
    answers = [_answer(a) for a in Execution(config, 1).compute(batch, backend, Timing())]
    for x, answer in zip(xs, answers, strict=True):
        np.testing.assert_array_equal(answer["Y"], x * 2)  # (its own shape back)
        assert answer["CALLS"].ravel().tolist() == [3] * x.shape[0]  # (one execute call)
        assert answer["SHAPES"][0].tolist() == [[1, 3], [1, 4], [2, 5]]


def test_outputs_of_different_shapes_are_each_requests_own(
    recording: tuple[ModelConfig, Backend],
) -> None:
    """What ``execute`` answers is kept per request where the shapes differ; the whole-batch
    view holds their elements one after the other."""
    _, backend = recording
    xs = _rows([1, 2])
    outputs = backend.infer(RaggedInputs({}, {"X": xs}), ["Y", "CALLS"], request_sizes=[1, 1])
    assert isinstance(outputs, RaggedOutputs) and set(outputs.parts) == {"Y"}
    assert [part.tolist() for part in outputs.parts["Y"]] == [[[20.0]], [[40.0, 42.0]]]
    assert outputs["Y"].tolist() == [20.0, 40.0, 42.0]
    assert outputs["CALLS"].tolist() == [[2], [2]] and outputs.absent == {}


def test_without_allow_ragged_batch_requests_of_different_shapes_go_apart(
    tmp_path: Path,
) -> None:
    plain = tensor("X", "TYPE_FP32", "-1")
    config, backend = _load(tmp_path, "apart", plain, RECORDING)
    backend.close()
    assert config.ragged_inputs == frozenset()
    keys = {_request(config, x, ["Y"]).key for x in _rows([3, 4, 3])}
    assert len(keys) == 2  # (the two of length 3 still share one)


def test_a_batch_that_shares_shapes_is_joined_as_before(
    recording: tuple[ModelConfig, Backend],
) -> None:
    config, _ = recording
    batch = [_request(config, x, ["Y"]) for x in _rows([3, 3])]
    inputs = combine(batch, config)
    assert not isinstance(inputs, RaggedInputs) and inputs["X"].shape == (2, 3)


def test_a_model_of_sluices_own_api_runs_once_per_shape(tmp_path: Path) -> None:
    """``execute`` takes one array per input: a batch of lengths 3, 4, 3 runs twice, the
    two requests of length 3 together, and each answer keeps its own shape."""
    config, backend = _load(tmp_path, "whole", RAGGED_X, WHOLE_ARRAYS)
    try:
        xs = _rows([3, 4, 3])
        batch = [_request(config, x, ["Y", "CALLS"]) for x in xs]
        answers = [_answer(a) for a in Execution(config, 1).compute(batch, backend, Timing())]
    finally:
        backend.close()
    for x, answer in zip(xs, answers, strict=True):
        np.testing.assert_array_equal(answer["Y"], x * 2)
    assert [answer["CALLS"].item() for answer in answers] == [1, 2, 1]


@pytest.mark.parametrize("entry", ["batch_input", "batch_output"])
def test_batch_inputs_and_outputs_stay_refused_for_python_models(entry: str) -> None:
    """Triton's Python backend makes no batch input and scatters no batch output (it reads
    only the requests' own tensors): Sluice refuses them rather than ignore them."""
    made = {
        "batch_input": 'batch_input [ { kind: BATCH_ELEMENT_COUNT target_name: "N" '
        'data_type: TYPE_INT32 source_input: "X" } ]',
        "batch_output": 'batch_output [ { target_name: "Y" '
        'kind: BATCH_SCATTER_WITH_INPUT_SHAPE source_input: "X" } ]',
    }[entry]
    text = 'name: "p"\n' + python_config([RAGGED_X], OUTPUTS, extra=made)
    with pytest.raises(InvalidConfig, match=r"not for 'python' \(Triton's Python backend ignores"):
        parse_config_text(text, model_name="p")


STREAMING = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            calls = np.full((x.shape[0], 1), len(requests), np.int32)
            sender = request.get_response_sender()
            outputs = [pb_utils.Tensor("Y", x * 2), pb_utils.Tensor("CALLS", calls)]
            sender.send(pb_utils.InferenceResponse(outputs))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""


def test_a_decoupled_model_streams_each_request_of_a_ragged_call_its_own_shape(
    tmp_path: Path,
) -> None:
    text = python_config([RAGGED_X], OUTPUTS, extra="model_transaction_policy { decoupled: true }")
    model_dir = write_model(tmp_path, "streaming", text, {"1/model.py": STREAMING})
    found = read_model(model_dir)
    assert found.config is not None, found.error
    config = found.config
    backend = load_backend(config, found.model_file(1), CPU)
    sent: dict[str, Any] = {}
    try:
        xs = _rows([2, 3])
        batch = [_request(config, x, ["Y", "CALLS"]) for x in xs]

        def send_partial(request: PendingRequest, reply: Any, payload: bytes) -> None:
            sent[request.message.request_key] = (reply.outputs, payload)

        finals = Execution(config, 1, send_partial=send_partial).compute(batch, backend, Timing())
    finally:
        backend.close()
    assert [answer for answer in finals if not isinstance(answer, tuple)] == []
    for x, request in zip(xs, batch, strict=True):
        answer = _answer(sent[request.message.request_key])
        np.testing.assert_array_equal(answer["Y"], x * 2)
        assert answer["CALLS"].tolist() == [[2]]
