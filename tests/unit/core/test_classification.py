"""Triton's classification extension: ranking, formatting, labels, and the worker's split."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from sluice.core.classification import classify, read_labels
from sluice.core.config import parse_config_text
from sluice.core.datatypes import deserialize_bytes, to_buffer
from sluice.core.errors import InvalidInput
from sluice.core.wire import RequestMessage, TensorHeader, decode_request, encode_request
from sluice.workers.tensors import PendingRequest, shape_key, split, validate

CONFIG = parse_config_text(
    """
    name: "m"
    platform: "onnxruntime_onnx"
    max_batch_size: 8
    input [ { name: "x" data_type: TYPE_FP32 dims: [ 3 ] } ]
    output [ { name: "p" data_type: TYPE_FP32 dims: [ 3 ] label_filename: "labels.txt" },
             { name: "n" data_type: TYPE_UINT8 dims: [ 4 ] },
             { name: "h" data_type: TYPE_FP16 dims: [ 3 ] } ]
    """,
    model_name="m",
)


def strings(shape_and_buffer: tuple[tuple[int, ...], bytes]) -> tuple[tuple[int, ...], list[str]]:
    shape, buffer = shape_and_buffer
    return shape, [element.decode() for element in deserialize_bytes(buffer)]


def test_top_classes_per_batch_item_with_labels_and_percent_f() -> None:
    probabilities = np.array([[0.1, 0.97, 0.3], [0.5, 0.25, 0.25]], np.float32)
    labels = [b"setosa", b"versicolor", b"virginica"]
    assert strings(classify(probabilities, 2, True, labels)) == (
        (2, 2),
        [
            "0.970000:1:versicolor",
            "0.300000:2:virginica",
            "0.500000:0:setosa",
            "0.250000:1:versicolor",
        ],
    )


def test_count_is_clamped_ties_keep_index_order_and_labels_are_optional() -> None:
    values = np.array([[3, 7, 7, 0]], np.uint8)
    assert strings(classify(values, 10, True, [b"a", b""])) == (
        (1, 4),
        ["7:1", "7:2", "3:0:a", "0:3"],
    )


def test_unbatched_output_and_nan_ranks_last() -> None:
    values = np.array([[np.nan, 1.0], [2.0, -1.0]], np.float64)
    assert strings(classify(values, 3, False, [])) == (
        (3,),
        ["2.000000:2", "1.000000:1", "-1.000000:3"],
    )


def test_labels_are_lines_as_triton_reads_them(tmp_path: Path) -> None:
    path = tmp_path / "labels.txt"
    path.write_bytes(b"cat\n\ndog\n")
    assert read_labels(path) == [b"cat", b"", b"dog"]
    path.write_bytes(b"")
    assert read_labels(path) == []


def pending(outputs: list[str], classes: dict[str, int]) -> PendingRequest:
    array = np.zeros((2, 3), np.float32)
    data = bytes(to_buffer("FP32", array))
    message = RequestMessage(
        "k", "r", [TensorHeader("x", "FP32", (2, 3), len(data))], outputs, classes=classes
    )
    decoded, payload = decode_request(encode_request(message, data))  # through the wire
    assert decoded.classes == classes
    return PendingRequest(b"0-1", decoded, payload, 2, shape_key(decoded, CONFIG))


def test_split_classifies_only_what_the_request_asks() -> None:
    request = pending(["p", "n"], {"p": 1})
    validate(request.message, CONFIG)
    outputs = {
        "p": np.array([[0.2, 0.7, 0.1], [0.6, 0.3, 0.1]], np.float32),
        "n": np.arange(8, dtype=np.uint8).reshape(2, 4),
    }
    [(headers, payload)] = split([request], outputs, CONFIG, {"p": [b"a", b"b", b"c"]})
    assert [(h.name, h.datatype, h.shape) for h in headers] == [
        ("p", "BYTES", (2, 1)),
        ("n", "UINT8", (2, 4)),
    ]
    classes = deserialize_bytes(payload[: headers[0].nbytes])
    assert classes == [b"0.700000:1:b", b"0.600000:0:a"]


@pytest.mark.parametrize(
    ("outputs", "classes", "fragment"),
    [
        (["p", "h"], {"h": 2}, "unsupported type 'FP16'"),
        (["p"], {"n": 2}, "not requested"),
    ],
)
def test_worker_rechecks_classification(
    outputs: list[str], classes: dict[str, int], fragment: str
) -> None:
    with pytest.raises(InvalidInput, match=fragment):
        validate(pending(outputs, classes).message, CONFIG)
