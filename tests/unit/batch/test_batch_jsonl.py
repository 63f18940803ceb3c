"""JSON Lines batch inputs: every way one line could make a large array is refused with the
line and the input named (an InvalidInput, which fails the shard once, with no retry), and
the file is read a line at a time, each within the line bound."""

from __future__ import annotations

import json
import time
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sluice.batch.formats import JsonLinesReader, open_input
from sluice.batch.jsonl import request_arrays
from sluice.core.config import ModelConfig, parse_config_text
from sluice.core.errors import InvalidInput

CONFIG = parse_config_text(
    """
    name: "m"
    backend: "python"
    max_batch_size: 8
    input [
      { name: "TEXT" data_type: TYPE_STRING dims: [ 1 ] },
      { name: "X" data_type: TYPE_FP32 dims: [ 4 ] optional: true },
      { name: "SEQ" data_type: TYPE_INT8 dims: [ -1 ] optional: true }
    ]
    output [ { name: "Y" data_type: TYPE_FP32 dims: [ 1 ] } ]
    """,
    model_name="m",
)


def _text(*values: Any, shape: list[int] | None = None) -> dict[str, Any]:
    return {
        "name": "TEXT",
        "datatype": "BYTES",
        "shape": shape or [len(values), 1],
        "data": list(values),
    }


def _request(*inputs: dict[str, Any]) -> dict[str, Any]:
    return {"inputs": list(inputs)}


def _refused(request: Any, config: ModelConfig = CONFIG) -> str:
    with pytest.raises(InvalidInput) as caught:
        request_arrays(request, config, "'input' line 3")
    return caught.value.message


def test_a_good_line_gives_the_model_its_arrays() -> None:
    arrays = request_arrays(
        _request(
            _text("a", "bc"),
            {
                "name": "X",
                "datatype": "FP32",
                "shape": [2, 4],
                "data": [[1, 2, 3, 4], [5, 6, 7, 8]],
            },
            {"name": "SEQ", "datatype": "INT8", "shape": [2, 3], "data": [-1, 0, 1, 2, 3, 127]},
        ),
        CONFIG,
        "'input' line 1",
    )
    assert arrays["TEXT"].tolist() == [[b"a"], [b"bc"]]
    assert arrays["X"].dtype == np.float32 and arrays["X"].shape == (2, 4)
    assert arrays["SEQ"].dtype == np.int8 and arrays["SEQ"][1].tolist() == [2, 3, 127]


def test_the_82_byte_line_that_took_gigabytes_is_a_clean_error_at_once() -> None:
    """A number as a BYTES element went through ``bytes(n)``: n zero bytes."""
    line = b'{"inputs":[{"name":"TEXT","shape":[1,1],"datatype":"BYTES","data":[6000000000]}]}'
    assert len(line) <= 82
    began = time.monotonic()
    message = _refused(json.loads(line))
    assert time.monotonic() - began < 1
    assert message.startswith("'input' line 3: input 'TEXT' element 0 must be a string")
    assert "got integer" in message


@pytest.mark.parametrize(
    ("value", "kind"),
    [(None, "null"), (True, "boolean"), (1.5, "number"), ([], "list"), ({}, "object")],
)
def test_bytes_elements_must_be_strings(value: Any, kind: str) -> None:
    message = _refused(_request(_text("ok", shape=[2, 1]) | {"data": ["ok", value]}))
    if kind == "list":  # (an empty list nests no element: one element short)
        assert "'data' holds 1 elements; shape [2, 1] needs 2" in message
    else:
        assert f"input 'TEXT' element 1 must be a string, got {kind}" in message


@pytest.mark.parametrize(
    ("shape", "reason"),
    [
        ([1, 2**31 - 1], "shape [1, 2147483647] does not fit the model's [rows, 1]"),
        ([2**31 - 1, 1], "2147483647 rows in one line, but model 'm' takes at most 8"),
        ([9, 1], "9 rows in one line, but model 'm' takes at most 8 per request (max_batch_size)"),
        ([1], "'shape' must be 2 non-negative integers [rows, 1]"),
        ([1, 1, 1], "'shape' must be 2 non-negative integers"),
        ([1, -1], "'shape' must be 2 non-negative integers"),
        ([1, 2**40], "'shape' must be 2 non-negative integers"),
        ([1, True], "'shape' must be 2 non-negative integers"),
        ("[1, 1]", "'shape' must be 2 non-negative integers"),
    ],
)
def test_shapes_beyond_the_model_are_refused_before_anything_is_built(
    shape: Any, reason: str
) -> None:
    message = _refused(_request(_text("a", shape=shape)))
    assert message.startswith("'input' line 3: input 'TEXT': ") and reason in message


def test_a_huge_variable_dim_with_tiny_data_is_refused_by_the_element_count() -> None:
    seq = {"name": "SEQ", "datatype": "INT8", "shape": [8, 2**31 - 1], "data": [1]}
    message = _refused(_request(_text(*"abcdefgh"), seq))
    assert "input 'SEQ': 'data' holds 1 elements; shape [8, 2147483647] needs 17179869176" in (
        message
    )


def test_more_data_than_the_shape_is_abandoned_early() -> None:
    seq = {"name": "SEQ", "datatype": "INT8", "shape": [1, 4], "data": [[0] * 1_000_000]}
    message = _refused(_request(_text("a"), seq))
    assert "input 'SEQ': 'data' holds more than the 4 elements of shape [1, 4]" in message


def test_ragged_nesting_is_flattened_without_recursion() -> None:
    deep: list[Any] = [5]
    for _ in range(50_000):
        deep = [deep]
    seq = {"name": "SEQ", "datatype": "INT8", "shape": [1, 2], "data": [deep, [[6]]]}
    arrays = request_arrays(_request(_text("a"), seq), CONFIG, "'input' line 1")
    assert arrays["SEQ"].tolist() == [[5, 6]]


@pytest.mark.parametrize(
    ("datatype", "data", "reason"),
    [
        ("INT8", [300, 0], "value 300 is out of range for INT8 [-128, 127]"),
        ("INT8", ["1", 2], "input 'SEQ' element 0 must be a number, got string"),
        ("INT8", [1, None], "input 'SEQ' element 1 must be a number, got null"),
        ("INT8", [1.5, 2], "INT8 data must be integers"),
        ("INT8", [2**70, 1], "input 'SEQ' element 0 is out of range for INT8"),
        ("INT8", [2**63, -1], "value 9223372036854775808 is out of range for INT8"),
    ],
)
def test_numbers_must_be_numbers_in_range(datatype: str, data: list[Any], reason: str) -> None:
    seq = {"name": "SEQ", "datatype": datatype, "shape": [1, 2], "data": data}
    assert reason in _refused(_request(_text("a"), seq))


def test_a_string_among_numbers_costs_no_more_than_its_bytes() -> None:
    """(numpy would make the list a fixed-width string array: 2,001 elements as wide as
    the longest, 20,000 characters of 4 bytes each, 160 MB for a 24 KB line.)"""
    data = ["x" * 20_000] + ["b"] * 2000
    seq = {"name": "SEQ", "datatype": "INT8", "shape": [1, 1, 2001], "data": data}
    config = parse_config_text(
        'name: "m"\nbackend: "onnxruntime"\nmax_batch_size: 4\n'
        'input [ { name: "SEQ" data_type: TYPE_INT8 dims: [ 1, 2001 ] } ]\n'
        'output [ { name: "Y" data_type: TYPE_FP32 dims: [ 1 ] } ]\n',
        model_name="m",
    )
    tracemalloc.start()
    try:
        with pytest.raises(InvalidInput, match="element 0 must be a number, got string"):
            request_arrays({"inputs": [seq]}, config, "'input' line 1")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 10 << 20


def test_a_float_overflow_is_refused() -> None:
    x = {"name": "X", "datatype": "FP32", "shape": [1, 4], "data": [1e300, 0, 0, 0]}
    assert "input 'X': a value is out of range for FP32" in _refused(_request(_text("a"), x))


@pytest.mark.parametrize(
    ("request_body", "reason"),
    [
        ([], "a request must be an object with an 'inputs' list"),
        ({"inputs": {}}, "a request must be an object with an 'inputs' list"),
        ({"inputs": [3]}, "input 0 must be an object"),
        (_request(_text("a") | {"name": "NOPE"}), "model 'm' has no input 'NOPE'"),
        (_request(_text("a") | {"name": 7}), "model 'm' has no input 'integer'"),
        (_request(_text("a") | {"datatype": "FP32"}), "input 'TEXT' takes BYTES, not 'FP32'"),
        (_request(_text("a") | {"data": "a"}), "'data' must be a list, got string"),
        (_request(_text("a") | {"data": None}), "'data' must be a list, got null"),
        (_request(_text("a"), _text("b")), "input 'TEXT' is given twice"),
        (_request(), "input 'TEXT' is missing"),
        (
            _request(
                _text("a"),
                {"name": "X", "datatype": "FP32", "shape": [2, 4], "data": [0] * 8},
            ),
            "the inputs do not have the same batch size",
        ),
    ],
)
def test_malformed_requests_name_what_is_wrong(request_body: Any, reason: str) -> None:
    message = _refused(request_body)
    assert message.startswith("'input' line 3: ") and reason in message, message


def _write_lines(path: Path, lines: list[bytes]) -> Path:
    path.write_bytes(b"".join(line + b"\n" for line in lines))
    return path


def _line(index: int) -> bytes:
    return json.dumps({"id": f"r{index}", "inputs": [_text(f"row {index}")]}).encode()


def test_lines_are_indexed_sparsely_and_read_from_any_row(tmp_path: Path) -> None:
    lines = []
    for index in range(3000):
        lines.append(_line(index))
        if index % 7 == 0:
            lines.append(b"   ")  # blank lines are not rows
    reader = open_input(_write_lines(tmp_path / "in.jsonl", lines), "jsonl", CONFIG, "")
    assert isinstance(reader, JsonLinesReader)
    assert reader.rows == 3000
    assert len(reader.checkpoints) == 3  # one offset per 1024 rows, not one per line
    taken = list(reader.lines(2040, 2050))
    assert [r["id"] for r in taken] == [f"r{i}" for i in range(2040, 2050)]
    assert [r["id"] for r in reader.lines(2995, 3100)] == [f"r{i}" for i in range(2995, 3000)]
    assert list(reader.lines(3000, 3010)) == []


def test_a_line_longer_than_the_bound_fails_its_row_and_is_never_held(tmp_path: Path) -> None:
    long = json.dumps({"inputs": [_text("x" * 5000)]}).encode()
    path = _write_lines(tmp_path / "in.jsonl", [_line(0), long, _line(2), b" " * 5000, _line(3)])
    reader = JsonLinesReader(path, max_line_bytes=1000)
    assert reader.rows == 4  # (a long blank line is still blank)
    rows = reader.lines(0, 4)
    assert next(rows)["id"] == "r0"
    with pytest.raises(InvalidInput) as caught:
        next(rows)
    assert caught.value.message.startswith(
        "'input' line 2: longer than 1000 bytes (SLUICE_BATCH_MAX_LINE_BYTES)"
    )
    assert [r["id"] for r in reader.lines(2, 4)] == ["r2", "r3"]


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b"{not json", "not JSON"),
        (b"[" * 100_000 + b"]" * 100_000, "not JSON: nested too deeply"),
        (b'{"inputs": [' + b"9" * 10_000 + b"]}", "not JSON"),
        (b"\xff\xfe{}", "not JSON"),
    ],
)
def test_lines_that_are_not_json_name_their_line(tmp_path: Path, raw: bytes, reason: str) -> None:
    reader = JsonLinesReader(_write_lines(tmp_path / "in.jsonl", [_line(0), _line(1), raw]))
    with pytest.raises(InvalidInput) as caught:
        list(reader.lines(0, 3))
    assert caught.value.message.startswith(f"'input' line 3: {reason}")
