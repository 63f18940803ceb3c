"""The client's codec and retry decisions, without a server: what it encodes, the gateway's
own request parser reads back exactly; what the gateway's response encoder writes, it decodes
exactly; malformed answers raise MalformedResponse saying what is wrong; error answers become
the server's exception classes."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np
import pytest

from sluice.client import calls
from sluice.client.codec import (
    HEADER_LENGTH,
    decode_response,
    decode_tensors,
    encode_json_request,
    encode_request,
    split_body,
)
from sluice.client.errors import JobCancelled, MalformedResponse, error_for, retry_after_s
from sluice.core.datatypes import to_buffer, to_numpy
from sluice.core.errors import (
    DeadlineExceeded,
    Forbidden,
    InferenceFailed,
    InvalidInput,
    NotFound,
    Overloaded,
    PayloadTooLarge,
    QuotaExceeded,
    SluiceError,
    Unauthorized,
    Unavailable,
    Unsupported,
)
from sluice.gateway.inference.parsing import parse_infer_request
from sluice.gateway.inference.response import OutputTensor, encode_infer_response
from tests.support.samples import FIXED_TYPES, sample

TEXTS = np.array([[b"hello", b"\xff\xfe not utf-8", b""], [b"w\xc3\xb6rld", b"a b", b"\x00z"]])
STRINGS = np.array([["héllo", "wörld", ""], ["x", "y y", "z"]])
ALL_TYPES = [*FIXED_TYPES, ("BYTES", np.object_)]


def example(datatype: str, dtype: Any) -> np.ndarray:
    if datatype == "BYTES":
        array = np.empty(TEXTS.shape, dtype=np.object_)
        array[...] = [[bytes(element) for element in row] for row in TEXTS]
        return array
    return sample(dtype, (2, 3))


def utf8_example() -> np.ndarray:
    array = np.empty(STRINGS.shape, dtype=np.object_)
    array[...] = [[element.encode() for element in row] for row in STRINGS]
    return array


def assert_same(actual: np.ndarray, expected: np.ndarray) -> None:
    assert actual.shape == expected.shape
    if expected.dtype.kind == "O":
        assert actual.dtype.kind == "O"
        assert actual.tolist() == expected.tolist()
    else:
        assert actual.dtype == expected.dtype
        np.testing.assert_array_equal(actual, expected)


# ------------------------------------------------------- the gateway's parser as a reader


@dataclass(frozen=True)
class Spec:
    name: str
    datatype: str
    dims: tuple[int, ...]
    reshape: tuple[int, ...] | None = None
    optional: bool = False


@dataclass(frozen=True)
class Config:
    name: str
    max_batch_size: int
    inputs: tuple[Spec, ...]
    outputs: tuple[Spec, ...]

    def input(self, name: str) -> Spec | None:
        return next((s for s in self.inputs if s.name == name), None)

    def output(self, name: str) -> Spec | None:
        return next((s for s in self.outputs if s.name == name), None)


def config_for(datatype: str) -> Config:
    return Config(
        "m", 8, (Spec("x", datatype, (3,)), Spec("n", "INT64", (1,), optional=True)),
        (Spec("y", datatype, (3,)), Spec("z", "FP32", (1,))),
    )  # fmt: skip


def server_reads(datatype: str, content: bytes, json_length: int | None) -> Any:
    return parse_infer_request(content, json_length, config_for(datatype))  # type: ignore[arg-type]


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
@pytest.mark.parametrize(("datatype", "dtype"), ALL_TYPES, ids=[t for t, _ in ALL_TYPES])
def test_every_datatype_is_read_back_by_the_gateway(
    datatype: str, dtype: Any, binary: bool
) -> None:
    array = example(datatype, dtype)
    body = encode_request({"x": array}, binary=binary)
    request = server_reads(datatype, body.content, body.json_length)
    [tensor] = request.inputs
    assert (tensor.name, tensor.datatype, tensor.shape) == ("x", datatype, (2, 3))
    assert_same(to_numpy(datatype, tensor.shape, tensor.data), array)
    # JSON carries what it can exactly; non-UTF-8 BYTES go binary even then.
    assert (body.json_length is None) == (not binary and datatype != "BYTES")


@pytest.mark.parametrize(("datatype", "dtype"), ALL_TYPES, ids=[t for t, _ in ALL_TYPES])
def test_every_datatype_round_trips_through_the_client_alone(datatype: str, dtype: Any) -> None:
    for binary in (True, False):
        array = example(datatype, dtype)
        body = encode_request({"x": array, "k": np.arange(3, dtype=np.int64)}, binary=binary)
        header, tail = split_body(body.content, body.json_length)
        decoded = decode_tensors(json.loads(header)["inputs"], tail)
        assert_same(decoded["x"], array)
        assert_same(decoded["k"], np.arange(3, dtype=np.int64))


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
@pytest.mark.parametrize(("datatype", "dtype"), ALL_TYPES, ids=[t for t, _ in ALL_TYPES])
def test_every_datatype_of_a_gateway_response_is_decoded(
    datatype: str, dtype: Any, binary: bool
) -> None:
    arrays = {"y": example(datatype, dtype), "z": np.array([[0.5], [-1.0]], dtype=np.float32)}
    if datatype == "BYTES" and not binary:
        arrays["y"] = utf8_example()  # else the gateway sends it binary anyway
    content, json_length = encode_infer_response(
        model_name="m",
        model_version="1",
        request_id="r",
        outputs=[
            OutputTensor(name, dt, a.shape, to_buffer(dt, a))
            for (name, a), dt in zip(arrays.items(), (datatype, "FP32"), strict=True)
        ],
        binary=[binary, binary],
    )
    assert (json_length is None) == (not binary)
    decoded = decode_response(content, json_length)
    assert list(decoded) == ["y", "z"]
    for name, array in arrays.items():
        assert_same(decoded[name], array)


def test_decoded_arrays_are_writable_copies() -> None:
    array = np.arange(6, dtype=np.float32).reshape(2, 3)
    content, json_length = encode_infer_response(
        model_name="m",
        model_version="1",
        request_id="",
        outputs=[OutputTensor("y", "FP32", (2, 3), to_buffer("FP32", array))],
        binary=[True],
    )
    decoded = decode_response(content, json_length)["y"]
    decoded += 1
    np.testing.assert_array_equal(decoded, array + 1)


def test_non_finite_floats_in_json_mode_go_binary() -> None:
    array = np.array([[1.0, np.nan, np.inf]], dtype=np.float32)
    body = encode_request({"x": array, "n": np.array([[1]])}, binary=False)
    assert body.json_length is not None
    header = json.loads(body.content[: body.json_length])
    x, n = header["inputs"]
    assert x["parameters"] == {"binary_data_size": 12} and "data" not in x
    assert n["data"] == [1]
    request = server_reads("FP32", body.content, body.json_length)
    np.testing.assert_array_equal(to_numpy("FP32", (1, 3), request.inputs[0].data), array)


def test_str_arrays_are_bytes_tensors() -> None:
    body = encode_request({"x": STRINGS}, binary=True)
    request = server_reads("BYTES", body.content, body.json_length)
    assert to_numpy("BYTES", (2, 3), request.inputs[0].data).tolist() == utf8_example().tolist()
    as_json = encode_request({"x": np.char.encode(STRINGS, "utf-8")}, binary=False)
    assert json.loads(as_json.content)["inputs"][0]["data"] == STRINGS.reshape(-1).tolist()


# ------------------------------------------------------------------- request structure


def test_a_binary_request_names_sizes_and_asks_for_binary_outputs() -> None:
    x = np.ones((1, 3), dtype=np.float32)
    body = encode_request({"x": x}, request_id="r-1", parameters={"priority": 1})
    assert body.headers() == {
        "Content-Type": "application/octet-stream",
        HEADER_LENGTH: str(body.json_length),
    }
    header = json.loads(body.content[: body.json_length])
    assert header == {
        "id": "r-1",
        "inputs": [
            {
                "name": "x",
                "shape": [1, 3],
                "datatype": "FP32",
                "parameters": {"binary_data_size": 12},
            }
        ],
        "parameters": {"priority": 1, "binary_data_output": True},
    }
    assert body.content[body.json_length :] == x.tobytes()

    named = encode_request({"x": x}, outputs=["y"])
    header = json.loads(named.content[: named.json_length])
    assert header["outputs"] == [{"name": "y", "parameters": {"binary_data": True}}]
    assert "parameters" not in header and "id" not in header


def test_a_json_request_is_plain_json() -> None:
    body = encode_request({"x": np.array([[1.5, 2]], np.float32)}, outputs=["y"], binary=False)
    assert body.json_length is None
    assert body.headers() == {"Content-Type": "application/json"}
    assert json.loads(body.content) == {
        "inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [1.5, 2.0]}],
        "outputs": [{"name": "y"}],
    }
    raw = {"inputs": [{"name": "x", "shape": [1], "datatype": "INT32", "data": [1]}]}
    assert json.loads(encode_json_request(raw).content) == raw


def test_an_input_of_no_protocol_datatype_is_refused() -> None:
    with pytest.raises(InvalidInput, match="input 'x': numpy dtype complex128"):
        encode_request({"x": np.array([1j])})


# ------------------------------------------------------------------- malformed answers


def good_response() -> tuple[bytes, int]:
    header = json.dumps(
        {
            "outputs": [
                {
                    "name": "y",
                    "datatype": "INT32",
                    "shape": [2],
                    "parameters": {"binary_data_size": 8},
                }
            ]
        }
    ).encode()
    return header + np.array([1, 2], dtype="<i4").tobytes(), len(header)


def malformed(content: bytes, json_length: Any, *fragments: str) -> None:
    with pytest.raises(MalformedResponse) as info:
        decode_response(content, json_length)
    assert info.value.message.startswith("malformed response: ")
    for fragment in fragments:
        assert fragment in info.value.message, info.value.message


def test_a_good_binary_response_decodes() -> None:
    content, length = good_response()
    np.testing.assert_array_equal(decode_response(content, str(length))["y"], [1, 2])


def test_malformed_responses_say_what_is_wrong() -> None:
    content, length = good_response()
    malformed(b"not json", None, "JSON header is invalid")
    malformed(b"[1, 2]", None, "not an object")
    malformed(b'{"model_name": "m"}', None, "'outputs' is missing")
    malformed(content, "twelve", "'twelve' is not an integer")
    malformed(content, len(content) + 1, "outside the body")
    malformed(content[:-1], length, "announces 8 bytes but only 7 are left")
    malformed(content + b"!", length, "1 bytes after the last output")
    wrong_shape = content.replace(b"[2]", b"[3]")
    malformed(wrong_shape, length, "output 'y' has 8 bytes, but shape [3] of INT32 takes 12")
    malformed(content.replace(b"INT32", b"INT33"), length, "unknown datatype 'INT33'")
    malformed(content.replace(b'"shape": [2]', b'"shape": [-2]'), length + 1, "no valid 'shape'")
    no_size = b'{"outputs": [{"name": "y", "datatype": "FP32", "shape": [1]}]}'
    malformed(no_size, None, "neither 'data' nor a valid parameters.binary_data_size")
    unnamed = b'{"outputs": [{"datatype": "FP32", "shape": [1], "data": [1]}]}'
    malformed(unnamed, None, "output 0 has no 'name'")


def test_malformed_json_data_says_what_is_wrong() -> None:
    def body(datatype: str, shape: list[int], data: Any) -> bytes:
        output = {"name": "y", "datatype": datatype, "shape": shape, "data": data}
        return json.dumps({"outputs": [output]}).encode()

    malformed(body("FP32", [3], [1, 2]), None, "output 'y' has 2 elements, shape [3] takes 3")
    malformed(body("FP32", [1], "1"), None, "'data' is not a list")
    malformed(body("INT32", [1], ["x"]), None, "'data' does not fit INT32")
    malformed(body("BYTES", [1], [1]), None, "BYTES data must be strings")


def test_truncated_binary_bytes_elements_are_malformed() -> None:
    raw = b"\x05\x00\x00\x00abc"  # announces 5 bytes, has 3
    header = json.dumps(
        {
            "outputs": [
                {
                    "name": "s",
                    "datatype": "BYTES",
                    "shape": [1],
                    "parameters": {"binary_data_size": len(raw)},
                }
            ]
        }
    ).encode()
    malformed(header + raw, len(header), "output 's'", "truncated")
    two = b"\x01\x00\x00\x00a\x01\x00\x00\x00b"
    header = header.replace(str(len(raw)).encode(), str(len(two)).encode())
    malformed(header + two, len(header), "2 BYTES elements, shape [1] takes 1")


# ------------------------------------------------------------------------------ errors


@pytest.mark.parametrize(
    ("status", "cls"),
    [
        (400, InvalidInput),
        (401, Unauthorized),
        (403, Forbidden),
        (404, NotFound),
        (410, JobCancelled),
        (413, PayloadTooLarge),
        (429, QuotaExceeded),
        (500, InferenceFailed),
        (501, Unsupported),
        (503, Unavailable),
        (504, DeadlineExceeded),
    ],
)
def test_each_status_is_its_error_class_with_the_servers_message(
    status: int, cls: type[SluiceError]
) -> None:
    error = error_for(status, b'{"error": "what the server said"}')
    assert type(error) is cls
    assert error.message == "what the server said"


def test_retry_after_makes_overloaded_and_odd_answers_keep_their_text() -> None:
    overloaded = error_for(503, b'{"error": "queue full"}', "7")
    assert isinstance(overloaded, Overloaded) and overloaded.retry_after_s == 7
    over_quota = error_for(429, b'{"error": "over its limit"}', "60")
    assert isinstance(over_quota, QuotaExceeded) and over_quota.retry_after_s == 60
    final = error_for(429, b'{"error": "the answer was not kept"}')  # (nothing to wait for)
    assert isinstance(final, QuotaExceeded) and final.retry_after_s is None
    assert overloaded.message == "queue full"
    teapot = error_for(418, b'{"error": "short and stout"}')
    assert type(teapot) is SluiceError and teapot.message == "HTTP 418: short and stout"
    assert (
        error_for(502, b"<html>bad gateway</html>").message == "HTTP 502: <html>bad gateway</html>"
    )
    assert error_for(500, b"").message == "HTTP 500 Internal Server Error"
    assert (retry_after_s("2.5"), retry_after_s("Wed, 21 Oct 2015"), retry_after_s(None)) == (
        2.5,
        None,
        None,
    )


# ----------------------------------------------------------------------------- retries


def answer(status: int, **headers: str) -> httpx.Response:
    return httpx.Response(status, headers=headers)


def test_retry_decisions() -> None:
    policy = calls.RetryPolicy(retries=3)
    call = calls.model_metadata("m")
    assert policy.after_response(call, 0, answer(503, **{"Retry-After": "2"})) == 2
    assert policy.after_response(call, 0, answer(429, **{"Retry-After": "600"})) == 30
    assert policy.after_response(call, 3, answer(503)) is None  # retries spent
    assert policy.after_response(call, 0, answer(500)) is None
    assert policy.after_response(call, 0, answer(200)) is None
    assert policy.after_response(calls.ready(), 0, answer(503)) is None  # never retried
    for attempt in range(10):
        delay = policy.after_response(call, 0, answer(503))
        assert delay is not None and 0.05 <= delay <= 0.1
        ceiling = min(5.0, 0.1 * 2**attempt)
        assert ceiling / 2 <= policy.backoff_s(attempt) <= ceiling
    refused = httpx.ConnectError("refused")
    assert policy.after_error(call, 0, refused) is not None
    assert policy.after_error(call, 3, refused) is None
    assert policy.after_error(call, 0, httpx.ReadTimeout("slow")) is None


def test_transport_failures_are_typed() -> None:
    assert isinstance(
        calls.transport_failure("http://h", httpx.ConnectError("refused")), Unavailable
    )
    late = calls.transport_failure("http://h", httpx.ReadTimeout("timed out"))
    assert isinstance(late, DeadlineExceeded) and "http://h" in late.message
