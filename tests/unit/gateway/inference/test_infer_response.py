"""encode_infer_response, read back by tritonclient's own response parser."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import orjson
import pytest
import tritonclient.http as httpclient

from sluice.core.datatypes import serialize_bytes, to_buffer
from sluice.core.errors import InferenceFailed
from sluice.gateway.inference.response import OutputTensor, encode_error, encode_infer_response
from tests.support.samples import FIXED_TYPES, sample


def tensor(name: str, datatype: str, array: np.ndarray) -> OutputTensor:
    return OutputTensor(name, datatype, tuple(array.shape), to_buffer(datatype, array))


def encode(
    outputs: list[OutputTensor], binary: list[bool], request_id: str = ""
) -> tuple[bytes, int | None]:
    return encode_infer_response(
        model_name="m", model_version="3", request_id=request_id, outputs=outputs, binary=binary
    )


def read(body: bytes, header_length: int | None) -> Any:
    return httpclient.InferenceServerClient.parse_response_body(body, header_length=header_length)


def header_of(body: bytes, header_length: int | None) -> dict[str, Any]:
    return orjson.loads(body if header_length is None else body[:header_length])


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
@pytest.mark.parametrize(("datatype", "dtype"), FIXED_TYPES, ids=[t for t, _ in FIXED_TYPES])
def test_every_fixed_width_datatype_round_trips(datatype: str, dtype: Any, binary: bool) -> None:
    array = sample(dtype, (2, 3))
    body, header_length = encode([tensor("OUT", datatype, array)], [binary])
    assert (header_length is None) == (not binary)
    result = read(body, header_length)
    got = result.as_numpy("OUT")
    assert got.dtype == array.dtype
    assert got.shape == (2, 3)
    np.testing.assert_array_equal(got, array)
    output = result.get_output("OUT")
    assert output["datatype"] == datatype
    if binary:
        assert output["parameters"] == {"binary_data_size": array.nbytes}
        assert "data" not in output
    else:
        assert "parameters" not in output
        assert len(output["data"]) == 6  # flat, row-major


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_bf16(binary: bool) -> None:
    as_bf16 = np.array([[1.5, -2.25, 3.0e10], [0.0, 1e-3, -7.0]], dtype=ml_dtypes.bfloat16)
    data = as_bf16.tobytes()
    body, header_length = encode([OutputTensor("OUT", "BF16", (2, 3), data)], [binary])
    got = read(body, header_length).as_numpy("OUT")
    assert got.dtype == ml_dtypes.bfloat16
    assert got.tobytes() == data


def test_bytes_utf8_as_json_and_binary() -> None:
    words = np.array([["héllo", ""], ["wörld", "x"]], dtype=np.object_)
    out = OutputTensor("S", "BYTES", (2, 2), serialize_bytes(words.ravel()))
    body, header_length = encode([out], [False])
    assert header_length is None
    assert header_of(body, None)["outputs"][0]["data"] == ["héllo", "", "wörld", "x"]
    got = read(body, None).as_numpy("S")
    assert got.shape == (2, 2)
    assert [s.decode() if isinstance(s, bytes) else s for s in got.ravel()] == list(words.ravel())

    body, header_length = encode([out], [True])
    assert header_length is not None
    got = read(body, header_length).as_numpy("S")
    assert got.ravel().tolist() == [w.encode() for w in words.ravel()]


def test_non_utf8_bytes_requested_as_json_go_binary() -> None:
    raw = [b"\xff\xfe", b"ok"]
    body, header_length = encode(
        [
            OutputTensor("S", "BYTES", (2,), serialize_bytes(raw)),
            tensor("F", "FP32", np.ones(2, np.float32)),
        ],
        [False, False],
    )
    assert header_length is not None
    outputs = header_of(body, header_length)["outputs"]
    assert outputs[0]["parameters"]["binary_data_size"] == len(serialize_bytes(raw))
    assert outputs[1]["data"] == [1.0, 1.0]
    result = read(body, header_length)
    assert result.as_numpy("S").tolist() == raw
    np.testing.assert_array_equal(result.as_numpy("F"), np.ones(2, np.float32))


def test_non_finite_floats_requested_as_json_go_binary() -> None:
    values = np.array([np.nan, np.inf, -1.0], dtype=np.float32)
    body, header_length = encode([tensor("F", "FP32", values)], [False])
    assert header_length is not None
    np.testing.assert_array_equal(read(body, header_length).as_numpy("F"), values)


def test_mixed_outputs_keep_order_and_byte_layout() -> None:
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    b = np.array([[1, 2]], dtype=np.int64)
    c = np.array([b"x", b"yz"], dtype=np.object_)
    d = np.array([True, False])
    outputs = [
        tensor("a", "FP32", a),
        tensor("b", "INT64", b),
        tensor("c", "BYTES", c),
        tensor("d", "BOOL", d),
    ]
    body, header_length = encode(outputs, [True, False, True, False], request_id="req-1")
    assert header_length is not None
    header = header_of(body, header_length)
    assert header["model_name"] == "m"
    assert header["model_version"] == "3"
    assert header["id"] == "req-1"
    assert [o["name"] for o in header["outputs"]] == ["a", "b", "c", "d"]
    assert body[header_length:] == a.tobytes() + serialize_bytes([b"x", b"yz"])
    result = read(body, header_length)
    np.testing.assert_array_equal(result.as_numpy("a"), a)
    np.testing.assert_array_equal(result.as_numpy("b"), b)
    assert result.as_numpy("c").tolist() == [b"x", b"yz"]
    np.testing.assert_array_equal(result.as_numpy("d"), d)


def test_id_omitted_when_empty_and_version_is_a_string() -> None:
    body, header_length = encode([tensor("a", "INT32", np.array([1], np.int32))], [False])
    assert header_length is None
    assert header_of(body, None) == {
        "model_name": "m",
        "model_version": "3",
        "outputs": [{"name": "a", "datatype": "INT32", "shape": [1], "data": [1]}],
    }
    assert read(body, None).get_response()["model_version"] == "3"


def test_zero_size_binary_outputs_add_no_bytes() -> None:
    empty = np.empty((0, 3), dtype=np.float32)
    body, header_length = encode([tensor("e", "FP32", empty)], [True])
    assert header_length is None  # nothing binary to send: pure JSON
    output = header_of(body, None)["outputs"][0]
    assert output["parameters"] == {"binary_data_size": 0}
    got = read(body, None).as_numpy("e")
    assert got.shape == (0, 3)

    one = np.array([4.0], np.float32)
    body, header_length = encode(
        [tensor("e", "FP32", empty), tensor("o", "FP32", one)], [True, True]
    )
    assert header_length is not None
    assert len(body) == header_length + 4
    result = read(body, header_length)
    assert result.as_numpy("e").shape == (0, 3)
    np.testing.assert_array_equal(result.as_numpy("o"), one)


def test_empty_json_output() -> None:
    body, header_length = encode([tensor("e", "INT8", np.empty((2, 0), np.int8))], [False])
    assert header_length is None
    assert header_of(body, None)["outputs"][0]["data"] == []
    assert read(body, None).as_numpy("e").shape == (2, 0)


def test_memoryview_data_is_appended_as_is() -> None:
    backing = bytearray(np.arange(4, dtype=np.int32).tobytes() + b"tail")
    view = memoryview(backing)[:16]
    body, header_length = encode([OutputTensor("v", "INT32", (4,), view)], [True])
    assert header_length is not None
    assert body[header_length:] == bytes(view)
    np.testing.assert_array_equal(
        read(body, header_length).as_numpy("v"), np.arange(4, dtype=np.int32)
    )


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="binary flags"):
        encode([tensor("a", "INT32", np.array([1], np.int32))], [])
    with pytest.raises(InferenceFailed, match="output 'a'"):
        encode([OutputTensor("a", "INT32", (2,), b"\x00" * 4)], [True])
    with pytest.raises(InferenceFailed, match="output 's'"):
        encode([OutputTensor("s", "BYTES", (2,), serialize_bytes([b"x"]))], [False])


def test_encode_error() -> None:
    assert orjson.loads(encode_error("input 'x': bad \"quote\"")) == {
        "error": "input 'x': bad \"quote\""
    }
