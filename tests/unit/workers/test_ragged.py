"""Ragged batching in the worker, without a server: the batch inputs of every kind (the
examples of Triton's documentation), a ragged input concatenated whatever the requests'
shapes, and an output scattered back by each request's input shape; a shape that a batch
input's type cannot hold, a request without a batch input's source, or an output of the
wrong size fails cleanly, and no request gets another's part."""

from __future__ import annotations

import math
from typing import cast

import numpy as np
import pytest

from sluice.core.config import ModelConfig, parse_config_text
from sluice.core.config.ragged import BATCH_INPUT_KINDS, BatchInput
from sluice.core.errors import InferenceFailed, InvalidConfig, InvalidInput
from sluice.core.wire import RequestMessage, TensorHeader
from sluice.workers import ragged
from sluice.workers.backends.base import Backend
from sluice.workers.execution import Execution
from sluice.workers.replies import Timing
from sluice.workers.tensors import PendingRequest, combine, shape_key, split, validate
from tests.support.onnx_models import RAGGED_CONFIG

CONFIG = parse_config_text(RAGGED_CONFIG.format(name="r", batch=3), model_name="r")


def made(kind: str, shapes: list[tuple[int, ...] | None]) -> list[object]:
    array = ragged.batch_input(BatchInput(kind, "T", "INT32", "S"), shapes)
    assert array.dtype == np.int32
    return [array.shape, array.tolist()]


def test_every_kind_of_batch_input() -> None:
    three = [(1, 3), (1, 4), (1, 5)]
    assert made("BATCH_ELEMENT_COUNT", three) == [(3,), [3, 4, 5]]
    assert made("BATCH_ACCUMULATED_ELEMENT_COUNT", three) == [(3,), [3, 7, 12]]
    assert made("BATCH_ACCUMULATED_ELEMENT_COUNT_WITH_ZERO", three) == [(4,), [0, 3, 7, 12]]
    assert made("BATCH_MAX_ELEMENT_COUNT_AS_SHAPE", three)[0] == (5,)
    # Triton's example: a batch-2 request [3, 1] and a batch-1 request [2, 2].
    items = [(2, 3, 1), (1, 2, 2)]
    assert made("BATCH_ITEM_SHAPE", items) == [(3, 2), [[3, 1], [3, 1], [2, 2]]]
    assert made("BATCH_ITEM_SHAPE_FLATTEN", items) == [(6,), [3, 1, 3, 1, 2, 2]]
    assert len(BATCH_INPUT_KINDS) == 6


def request(number: int, values: list[float], config: ModelConfig = CONFIG) -> PendingRequest:
    data = np.asarray(values, dtype=np.float32)
    header = TensorHeader("INPUT", "FP32", (1, len(values)), data.nbytes)
    message = RequestMessage(f"r{number}", "r", [header], ["OUT", "LAST"])
    key = shape_key(message, config)
    return PendingRequest(f"{number}-0".encode(), message, memoryview(data.tobytes()), 1, key)


def test_requests_of_any_shapes_share_a_batch_and_get_their_own_part_back() -> None:
    batch = [request(1, [1, 2, 3]), request(2, [4, 5, 6, 7]), request(3, [8, 9, 10, 11, 12])]
    assert len({r.key for r in batch}) == 1
    arrays = combine(batch, CONFIG)
    assert arrays["INPUT"].shape == (12,)
    assert arrays["INDEX"].tolist() == [3.0, 7.0, 12.0]
    outputs = {"OUT": arrays["INPUT"] * 2, "LAST": arrays["INDEX"].reshape(-1, 1)}
    answers = split(batch, outputs, CONFIG)
    shapes = [[h.shape for h in headers] for headers, _ in answers]
    assert shapes == [[(1, 3), (1, 1)], [(1, 4), (1, 1)], [(1, 5), (1, 1)]]
    first, _ = answers[0]
    out = np.frombuffer(answers[0][1][: first[0].nbytes], dtype=np.float32)
    assert out.tolist() == [2.0, 4.0, 6.0]


def test_an_output_that_does_not_add_up_fails_the_batch() -> None:
    batch = [request(1, [1, 2]), request(2, [3])]
    with pytest.raises(
        InferenceFailed, match="has 4 elements; scattering it by input 'INPUT' needs 3"
    ):
        split(batch, {"OUT": np.zeros(4, dtype=np.float32)}, CONFIG)


GOOD = RAGGED_CONFIG.format(name="r", batch=3)


@pytest.mark.parametrize(
    ("old", "new", "reason"),
    [
        ('target_name: "INDEX"', 'target_name: "INPUT"', "batch_input 'INPUT': target_name is"),
        (
            'source_input: "INPUT" } ]\nbatch_output',
            'source_input: "NOPE" } ]\nbatch_output',
            "batch_input 'INDEX': source_input must name one input",
        ),
        (
            "data_type: TYPE_FP32 source_input",
            "data_type: TYPE_STRING source_input",
            "batch_input 'INDEX': data_type must be one of TYPE_INT32",
        ),
        (
            'target_name: "OUT" kind',
            'target_name: "NOPE" kind',
            "batch_output #0: target_name 'NOPE' is not an output",
        ),
        (
            "max_batch_size: 8",
            "max_batch_size: 0",
            "batch_input and batch_output need a model that batches",
        ),
        (
            'target_name: "OUT" kind',
            'target_name: [ "OUT", "OUT" ] kind',
            "batch_output #0: target_name 'OUT' is named twice",
        ),
        (
            'source_input: "INPUT" } ]\ndynamic',
            'source_input: "INPUT" }, { target_name: "OUT" source_input: "INPUT" } ]\ndynamic',
            "batch_output #1: target_name 'OUT' is named twice",
        ),
        (
            'backend: "onnxruntime"',
            'backend: "python"',
            "batch_input and batch_output are made for backends that take a batch as one "
            "tensor per input, not for 'python'",
        ),
    ],
)
def test_bad_batch_inputs_and_outputs_are_refused_naming_them(
    old: str, new: str, reason: str
) -> None:
    assert old in GOOD
    text = GOOD.replace(old, new)
    if new == "max_batch_size: 0":
        text = text[: text.index("dynamic_batching")]
    with pytest.raises(InvalidConfig, match=reason):
        parse_config_text(text, model_name="r")


def test_a_model_that_takes_each_request_alone_keeps_its_shapes_apart() -> None:
    """A TorchServe handler gets no concatenated batch: its ragged input is not
    concatenated, and requests of different shapes go in different batches (a Python
    model's share one: tests/unit/workers/test_python_ragged.py)."""
    text = GOOD[: GOOD.index("batch_input")].replace('"onnxruntime"', '"torchserve"')
    config = parse_config_text(text, model_name="r")
    assert config.inputs[0].allow_ragged_batch and config.ragged_inputs == frozenset()
    keys = {request(n, [0.0] * n, config).key for n in (3, 4)}
    assert len(keys) == 2


def test_an_output_with_too_few_elements_fails_the_batch_naming_it() -> None:
    """A model that returns fewer elements than the requests' shapes need fails the batch
    with the sizes named (no request gets a short or shifted part)."""
    batch = [request(1, [1, 2, 3, 4, 5]), request(2, [6])]
    with pytest.raises(
        InferenceFailed, match="has 4 elements; scattering it by input 'INPUT' needs 6"
    ):
        split(batch, {"OUT": np.zeros(4, dtype=np.float32)}, CONFIG)


def test_a_scatter_size_past_the_output_is_refused_before_slicing() -> None:
    """An empty input with a huge dimension asks for a part far larger than the output."""
    huge = [(1, 2**62, 0)]
    with pytest.raises(InferenceFailed, match="has 0 elements; scattering it by input 'IN'"):
        ragged.scattered("OUT", np.zeros(0, dtype=np.float32), (-1,), "IN", huge)


@pytest.mark.parametrize(
    ("kind", "shapes"),
    [
        ("BATCH_ITEM_SHAPE", [(1, 0, 3_000_000_000)]),
        ("BATCH_ITEM_SHAPE_FLATTEN", [(1, 0, 3_000_000_000)]),
        ("BATCH_ELEMENT_COUNT", [(1, 3_000_000_000)]),
        ("BATCH_ACCUMULATED_ELEMENT_COUNT", [(1, 2_000_000_000), (1, 2_000_000_000)]),
        ("BATCH_ACCUMULATED_ELEMENT_COUNT_WITH_ZERO", [(1, 2_000_000_000), (1, 2**31)]),
    ],
)
def test_a_value_the_batch_input_type_cannot_hold_is_the_requests_error(
    kind: str, shapes: list[tuple[int, ...] | None]
) -> None:
    """An INT32 batch input never wraps: the error is InvalidInput, on which the worker
    runs the batch's requests one by one, so only the request whose shape it is fails."""
    with pytest.raises(InvalidInput, match="input 'S': its shape gives batch input 'T' "):
        ragged.batch_input(BatchInput(kind, "T", "INT32", "S"), shapes)
    as_float = ragged.batch_input(BatchInput(kind, "T", "FP32", "S"), shapes)
    assert as_float.dtype == np.float32 and as_float.max() >= 2**31


OPTIONAL_SOURCE = parse_config_text(
    GOOD.replace("allow_ragged_batch: true", "allow_ragged_batch: true optional: true").replace(
        'input [ { name: "INPUT"',
        'input [ { name: "OTHER" data_type: TYPE_FP32 dims: [ 1 ] },\n  { name: "INPUT"',
    ),
    model_name="r",
)


def test_a_request_without_the_source_of_a_batch_input_is_refused() -> None:
    """Triton fails a request whose batch input's source it cannot find; made from nothing,
    the counts would be zeros and the item shapes one row per request."""
    data = np.zeros((1, 1), dtype=np.float32)
    header = TensorHeader("OTHER", "FP32", (1, 1), data.nbytes)
    message = RequestMessage("r1", "r", [header], ["LAST"])
    with pytest.raises(InvalidInput, match="input 'INPUT' is required: the model's batch"):
        validate(message, OPTIONAL_SOURCE)
    present = TensorHeader("INPUT", "FP32", (1, 2), 8)
    validate(RequestMessage("r2", "r", [header, present], ["LAST"]), OPTIONAL_SOURCE)


class Doubling:
    """A ragged model: OUT is twice the concatenated INPUT, LAST one row per item."""

    def infer(
        self, inputs: dict[str, np.ndarray], wanted: list[str], request_sizes: list[int]
    ) -> dict[str, np.ndarray]:
        assert inputs["SHAPES"].dtype == np.int32
        return {"OUT": inputs["INPUT"] * 2, "LAST": np.zeros((sum(request_sizes), 1), np.float32)}


def test_a_shape_the_batch_input_cannot_hold_fails_only_its_own_request() -> None:
    """An empty tensor whose dimension is past 2**31 (a client's choice) in a batch of
    others: the batch runs request by request, and only that one is refused."""
    text = (
        GOOD.replace("dims: [ -1 ] allow", "dims: [ -1, -1 ] allow")
        .replace(
            '{ name: "OUT" data_type: TYPE_FP32 dims: [ -1 ]',
            '{ name: "OUT" data_type: TYPE_FP32 dims: [ -1, -1 ]',
        )
        .replace(
            'BATCH_ACCUMULATED_ELEMENT_COUNT target_name: "INDEX"',
            'BATCH_ITEM_SHAPE target_name: "SHAPES"',
        )
        .replace("data_type: TYPE_FP32 source_input", "data_type: TYPE_INT32 source_input")
    )
    config = parse_config_text(text, model_name="r")

    def shaped(number: int, shape: tuple[int, ...]) -> PendingRequest:
        data = np.arange(math.prod(shape), dtype=np.float32)
        header = TensorHeader("INPUT", "FP32", shape, data.nbytes)
        message = RequestMessage(f"r{number}", "r", [header], ["OUT"])
        key = shape_key(message, config)
        return PendingRequest(f"{number}-0".encode(), message, memoryview(data.tobytes()), 1, key)

    batch = [shaped(1, (1, 2, 3)), shaped(2, (1, 0, 3_000_000_000)), shaped(3, (1, 1, 2))]
    answers = Execution(config, 1).compute(batch, cast(Backend, Doubling()), Timing())
    assert isinstance(answers[1], InvalidInput)
    assert "batch input 'SHAPES' the value 3000000000" in answers[1].message
    first, third = answers[0], answers[2]
    assert not isinstance(first, Exception) and not isinstance(third, Exception)
    assert [h.shape for h in first[0]] == [(1, 2, 3)]
    assert np.frombuffer(third[1], dtype=np.float32).tolist() == [0.0, 2.0]
