from __future__ import annotations

import numpy as np
import pytest

from sluice.core.config import parse_config_text
from sluice.core.datatypes import to_buffer
from sluice.core.errors import InferenceFailed, InvalidInput
from sluice.core.wire import RequestMessage, TensorHeader
from sluice.workers.tensors import (
    PendingRequest,
    combine,
    output_names,
    shape_key,
    split,
    validate,
)

CONFIG = parse_config_text(
    """
    name: "m"
    platform: "onnxruntime_onnx"
    max_batch_size: 8
    input [ { name: "x" data_type: TYPE_FP32 dims: [ -1 ] } ]
    output [ { name: "y" data_type: TYPE_FP32 dims: [ -1 ] },
             { name: "z" data_type: TYPE_INT64 dims: [ 1 ] } ]
    """,
    model_name="m",
)


def pending(key: str, array: np.ndarray, outputs: list[str]) -> PendingRequest:
    data = bytes(to_buffer("FP32", array))
    message = RequestMessage(key, "r", [TensorHeader("x", "FP32", array.shape, len(data))], outputs)
    return PendingRequest(
        b"0-1", message, memoryview(data), array.shape[0], shape_key(message, CONFIG)
    )


def test_combine_and_split_follow_each_request() -> None:
    a = pending("a", np.ones((2, 3), np.float32), ["y"])
    b = pending("b", np.full((1, 3), 5, np.float32), ["z", "y"])
    assert a.key == b.key
    inputs = combine([a, b], CONFIG)
    assert inputs["x"].shape == (3, 3)
    assert output_names([a, b]) == ["y", "z"]
    outputs = {"y": inputs["x"] * 2, "z": np.arange(3, dtype=np.int64).reshape(3, 1)}
    (a_headers, a_data), (b_headers, b_data) = split([a, b], outputs, CONFIG)
    assert [h.name for h in a_headers] == ["y"] and a_headers[0].shape == (2, 3)
    assert np.frombuffer(a_data, np.float32).tolist() == [2.0] * 6
    assert [h.name for h in b_headers] == ["z", "y"]
    assert np.frombuffer(b_data[:8], np.int64).tolist() == [2]
    assert np.frombuffer(b_data[8:], np.float32).tolist() == [10.0] * 3


def test_different_item_shapes_do_not_share_a_batch() -> None:
    a = pending("a", np.ones((1, 3), np.float32), ["y"])
    b = pending("b", np.ones((1, 4), np.float32), ["y"])
    assert a.key != b.key


def test_wrong_output_batch_dimension_fails_the_batch() -> None:
    a = pending("a", np.ones((2, 3), np.float32), ["y"])
    with pytest.raises(InferenceFailed, match="batch dimension"):
        split([a], {"y": np.ones((3, 3), np.float32)}, CONFIG)


def test_a_shape_the_model_does_not_take_is_refused_before_the_batch() -> None:
    """An ensemble's step (or a Python model's call) reaches the stream without a gateway:
    the worker checks the shape as the gateway checks a client's, with Triton's text."""
    fixed = parse_config_text(
        """
        name: "f"
        platform: "onnxruntime_onnx"
        max_batch_size: 8
        input [ { name: "x" data_type: TYPE_FP32 dims: [ 2, -1 ] } ]
        output [ { name: "y" data_type: TYPE_FP32 dims: [ 2, -1 ] } ]
        """,
        model_name="f",
    )
    for shape in ((3, 2, 5), (1, 2, 0)):
        validate(RequestMessage("a", "r", [TensorHeader("x", "FP32", shape, 0)], ["y"]), fixed)
    for shape in ((1, 3, 5), (2, 5), (1, 2, 5, 1), ()):
        message = RequestMessage(
            "a", "r", [TensorHeader("x", "FP32", shape, 0)], ["y"], client_id="req-7"
        )
        with pytest.raises(InvalidInput) as info:
            validate(message, fixed)
        assert info.value.message == (
            "[request id: req-7] unexpected shape for input 'x' for model 'f'. Expected "
            f"[-1,2,-1], got [{','.join(map(str, shape))}]"
        )
