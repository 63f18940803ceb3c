"""gRPC requests turned into the REST path's form, and answers into ModelInferResponse."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from tritonclient.grpc import service_pb2

from sluice.core.errors import InferenceFailed, InvalidInput
from sluice.gateway.grpc_api.tensors import encode_response, request_document
from sluice.gateway.inference.fields import MAX_DIMS
from sluice.gateway.inference.response import OutputTensor


def _request() -> service_pb2.ModelInferRequest:
    return service_pb2.ModelInferRequest(model_name="m", id="r")


def test_typed_contents_become_tritons_binary_layout() -> None:
    request = _request()
    int8 = request.inputs.add(name="A", datatype="INT8", shape=[1, 3])
    int8.contents.int_contents.extend([1, -2, 300])  # Triton keeps the low byte: 300 -> 44
    uint16 = request.inputs.add(name="B", datatype="UINT16", shape=[2])
    uint16.contents.uint_contents.extend([65535, 65537])
    text = request.inputs.add(name="C", datatype="BYTES", shape=[2])
    text.contents.bytes_contents.extend([b"ab", b""])
    flags = request.inputs.add(name="D", datatype="BOOL", shape=[2])
    flags.contents.bool_contents.extend([True, False])
    request.parameters["priority"].uint64_param = 2
    request.parameters["note"].string_param = "x"
    request.outputs.add(name="OUT").parameters["classification"].int64_param = 2

    document, binary = request_document(request)
    assert document["id"] == "r"
    assert document["parameters"] == {"priority": 2, "note": "x"}
    assert document["outputs"] == [{"name": "OUT", "parameters": {"classification": 2}}]
    sizes = [entry["parameters"]["binary_data_size"] for entry in document["inputs"]]
    assert sizes == [3, 4, 4 + 2 + 4, 2]
    data = bytes(binary)
    assert np.frombuffer(data[:3], np.int8).tolist() == [1, -2, 44]
    assert np.frombuffer(data[3:7], "<u2").tolist() == [65535, 1]
    assert data[7:17] == b"\x02\x00\x00\x00ab\x00\x00\x00\x00"
    assert data[17:] == b"\x01\x00"


def test_raw_contents_are_taken_in_order_skipping_inputs_in_shared_memory() -> None:
    request = _request()
    request.inputs.add(name="A", datatype="FP32", shape=[1])
    shm = request.inputs.add(name="S", datatype="FP32", shape=[1])
    shm.parameters["shared_memory_region"].string_param = "region"
    shm.parameters["shared_memory_byte_size"].int64_param = 4
    shm.parameters["binary_data_size"].int64_param = 99  # REST's: never taken over gRPC
    request.inputs.add(name="B", datatype="FP32", shape=[1])
    request.raw_input_contents.extend([b"aaaa", b"bbbb"])
    document, binary = request_document(request)
    assert bytes(binary) == b"aaaabbbb"
    assert document["inputs"][1]["parameters"] == {
        "shared_memory_region": "region",
        "shared_memory_byte_size": 4,
    }
    assert document["inputs"][2]["parameters"] == {"binary_data_size": 4}


@pytest.mark.parametrize(
    ("build", "fragment"),
    [
        (lambda t: t.contents.fp32_contents.extend([1.0]), "of type 'FP32', expected datatype"),
        (
            lambda t: (t.contents.int64_contents.extend([1]), t.contents.fp64_contents.extend([1])),
            "binary data was already supplied",
        ),
    ],
)
def test_typed_contents_that_do_not_fit(build, fragment: str) -> None:  # type: ignore[no-untyped-def]
    request = _request()
    build(request.inputs.add(name="A", datatype="INT64", shape=[1]))
    with pytest.raises(InvalidInput, match=fragment):
        request_document(request)


def test_a_parameter_without_a_value_is_refused() -> None:
    request = _request()
    request.parameters["timeout"].SetInParent()
    request.inputs.add(name="A", datatype="FP32", shape=[1])
    request.raw_input_contents.append(b"aaaa")
    with pytest.raises(InvalidInput, match="invalid value type for 'timeout' parameter"):
        request_document(request)


def test_answers_carry_every_output_in_order() -> None:
    outputs = [
        OutputTensor("A", "FP32", (2,), np.array([1, 2], np.float32).tobytes()),
        OutputTensor("S", "FP32", (2,), b"", region="out", region_bytes=8),
        OutputTensor("T", "BYTES", (1,), b"\x01\x00\x00\x00z"),
    ]
    response = service_pb2.ModelInferResponse.FromString(encode_response("m", "3", "r", outputs))
    assert (response.model_name, response.model_version, response.id) == ("m", "3", "r")
    assert [o.name for o in response.outputs] == ["A", "S", "T"]
    assert list(response.raw_output_contents) == [outputs[0].data, b"", b"\x01\x00\x00\x00z"]
    assert response.outputs[1].parameters["shared_memory_region"].string_param == "out"
    assert response.outputs[1].parameters["shared_memory_byte_size"].int64_param == 8
    with pytest.raises(InferenceFailed, match="do not fit shape"):
        encode_response("m", "1", "", [OutputTensor("A", "FP32", (3,), b"1234")])


def test_only_the_parameters_a_tensor_can_use_are_read() -> None:
    """Others are ignored, as Triton ignores them, however many (or unset) they are."""
    request = _request()
    tensor = request.inputs.add(name="A", datatype="FP32", shape=[1])
    for index in range(1000):
        tensor.parameters[f"p{index}"].string_param = "x"
    tensor.parameters["unset"].SetInParent()
    request.raw_input_contents.append(b"aaaa")
    output = request.outputs.add(name="OUT")
    output.parameters["binary_data"].bool_param = True
    output.parameters["shared_memory_region"].string_param = "out"
    output.parameters["shared_memory_byte_size"].int64_param = 4
    output.parameters["other"].SetInParent()
    document, _ = request_document(request)
    assert document["inputs"][0]["parameters"] == {"binary_data_size": 4}
    assert document["outputs"] == [
        {
            "name": "OUT",
            "parameters": {"shared_memory_region": "out", "shared_memory_byte_size": 4},
        }
    ]


def test_reserved_parameters_are_read_in_tritons_kinds() -> None:
    request = _request()
    request.inputs.add(name="A", datatype="FP32", shape=[1])
    request.raw_input_contents.append(b"aaaa")
    request.parameters["sequence_id"].int64_param = -2
    request.parameters["priority"].int64_param = 3
    request.parameters["custom"].uint64_param = (1 << 64) - 1
    # Triton's core holds a timeout as an unsigned integer: -1 is the longest one.
    request.parameters["timeout"].int64_param = -1
    document, _ = request_document(request)
    assert document["parameters"] == {
        "sequence_id": (1 << 64) - 2,
        "priority": 3,
        "custom": (1 << 64) - 1,
        "timeout": (1 << 64) - 1,
    }
    request.parameters["timeout"].uint64_param = 5
    with pytest.raises(InvalidInput, match=r"^invalid value type for 'timeout' parameter"):
        request_document(request)


def test_bytes_contents_of_many_strings() -> None:
    request = _request()
    text = request.inputs.add(name="T", datatype="BYTES", shape=[3000])
    text.contents.bytes_contents.extend([b"", b"xy", b"\x00"] * 1000)
    _, binary = request_document(request)
    assert (
        bytes(binary)
        == (b"\x00\x00\x00\x00" + b"\x02\x00\x00\x00xy" + b"\x01\x00\x00\x00\x00") * 1000
    )


def test_a_shape_past_the_most_dims_is_refused_before_it_is_read() -> None:
    request = _request()
    request.inputs.add(name="A", datatype="FP32", shape=[1] * MAX_DIMS)
    request.raw_input_contents.append(b"aaaa")
    assert request_document(request)[0]["inputs"][0]["shape"] == [1] * MAX_DIMS
    request.inputs[0].shape.append(1)
    with pytest.raises(
        InvalidInput, match=r"^input 'A': 'shape' has 65 dims, more than the limit of 64$"
    ):
        request_document(request)


_EXTREMES = [
    ("INT32", "int_contents", np.array([0, 1, 127, 128, -1, -(2**31), 2**31 - 1], "<i4")),
    ("INT64", "int64_contents", np.array([0, 127, 300, -1, -(2**63), 2**63 - 1], "<i8")),
    ("UINT32", "uint_contents", np.array([0, 127, 128, 2**32 - 1], "<u4")),
    ("UINT64", "uint64_contents", np.array([0, 127, 2**63, 2**64 - 1], "<u8")),
    ("FP32", "fp32_contents", np.array([0.0, -0.0, 1.5, np.inf, -np.inf, 3.4e38], "<f4")),
    ("FP64", "fp64_contents", np.array([0.0, -0.0, 1e-300, np.inf, -1e308], "<f8")),
    ("BOOL", "bool_contents", np.array([True, False, True], "?")),
    ("INT8", "int_contents", np.array([0, 127, 128, -1, -129, 300, -(2**31)], "<i4")),
    ("INT16", "int_contents", np.array([0, 127, 40000, -1, -40000, 2**31 - 1], "<i4")),
    ("UINT8", "uint_contents", np.array([0, 127, 255, 256, 2**32 - 1], "<u4")),
    ("UINT16", "uint_contents", np.array([0, 127, 65535, 65536, 2**32 - 1], "<u4")),
    ("INT64", "int64_contents", np.arange(128, dtype="<i8")),  # (one byte each on the wire)
    # First and last of one byte, others not:
    ("INT32", "int_contents", np.array([0, -1, 300, -(2**31), 5], "<i4")),
    ("UINT64", "uint64_contents", np.array([1, 2**64 - 1, 128, 0], "<u8")),
    ("INT8", "int_contents", np.array([0, 300, -129, 1], "<i4")),
    ("UINT16", "uint_contents", np.array([3, 65536 + 7, 2**32 - 1, 127], "<u4")),
]
_NARROW = {"INT8": "<i1", "INT16": "<i2", "UINT8": "<u1", "UINT16": "<u2"}


@pytest.mark.parametrize(("datatype", "field", "values"), _EXTREMES)
def test_numeric_contents_keep_every_value(
    datatype: str, field: str, values: np.ndarray[Any, Any]
) -> None:
    """Extremes of each field's type, and values past a narrowed datatype's range, which
    keep their low bytes as Triton keeps them (300 as INT8 is 44), never refused."""
    request = _request()
    tensor = request.inputs.add(name="A", datatype=datatype, shape=[len(values)])
    getattr(tensor.contents, field).extend(values.tolist())
    # As the gateway gets it: decoded from the wire.
    request = service_pb2.ModelInferRequest.FromString(request.SerializeToString())
    document, binary = request_document(request)
    expected = values.astype(_NARROW.get(datatype, values.dtype)).tobytes()
    assert bytes(binary) == expected
    assert document["inputs"][0]["parameters"] == {"binary_data_size": len(expected)}


def test_numeric_contents_that_need_no_decoding_are_not_read_value_by_value(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Floats, booleans and integers of one byte on the wire are taken from the packed
    encoding; an integer of more bytes is still read value by value."""
    request = _request()
    request.inputs.add(name="F", datatype="FP32", shape=[3]).contents.fp32_contents.extend(
        [1.5, -2.0, 0.25]
    )
    request.inputs.add(name="D", datatype="FP64", shape=[1]).contents.fp64_contents.append(9.5)
    request.inputs.add(name="B", datatype="BOOL", shape=[2]).contents.bool_contents.extend(
        [False, True]
    )
    request.inputs.add(name="I", datatype="INT8", shape=[2]).contents.int_contents.extend([5, 7])
    request.inputs.add(name="U", datatype="UINT64", shape=[1]).contents.uint64_contents.append(1)

    def one_at_a_time(*args: object, **kwargs: object) -> None:
        raise AssertionError("read value by value")

    monkeypatch.setattr(np, "fromiter", one_at_a_time)
    _, binary = request_document(request)
    assert bytes(binary) == (
        np.array([1.5, -2.0, 0.25], "<f4").tobytes()
        + np.array([9.5], "<f8").tobytes()
        + b"\x00\x01"
        + b"\x05\x07"
        + np.array([1], "<u8").tobytes()
    )
    request.inputs[4].contents.uint64_contents.append(128)  # (two bytes on the wire)
    with pytest.raises(AssertionError, match="value by value"):
        request_document(request)


_REGION = "shared_memory_region"
_OFFSET = "shared_memory_offset"
_SIZE = "shared_memory_byte_size"


def _shm(parameters: Any, given: dict[str, tuple[str, object]]) -> None:
    for name, (kind, value) in given.items():
        setattr(parameters[name], kind, value)


_TRITON_SHM_ANSWERS = [
    (
        {_REGION: ("int64_param", 1), _SIZE: ("int64_param", 4)},
        "invalid value type for 'shared_memory_region' parameter for tensor '{}', "
        "expected string_param.",
    ),
    (
        {_REGION: ("string_param", "r"), _OFFSET: ("string_param", "0"), _SIZE: ("int64_param", 4)},
        "invalid value type for 'shared_memory_offset' parameter for tensor '{}', "
        "expected int64_param.",
    ),
    (
        {_REGION: ("string_param", "r"), _OFFSET: ("uint64_param", 0), _SIZE: ("int64_param", 4)},
        "invalid value type for 'shared_memory_offset' parameter for tensor '{}', "
        "expected int64_param.",
    ),
    (
        {_REGION: ("string_param", "r"), _SIZE: ("uint64_param", 4)},
        "invalid value type for 'shared_memory_byte_size' parameter for tensor '{}', "
        "expected int64_param.",
    ),
    (
        {_OFFSET: ("string_param", "x"), _SIZE: ("int64_param", 4)},
        "'shared_memory_offset' can not be specified without 'shared_memory_region' "
        "parameter for tensor '{}'",
    ),
    (
        {_SIZE: ("int64_param", 4)},
        "'shared_memory_byte_size' can not be specified without 'shared_memory_region' "
        "parameter for tensor '{}'",
    ),
    (
        {_REGION: ("string_param", "r"), _OFFSET: ("int64_param", 0)},
        "'shared_memory_byte_size' must be specified along with 'shared_memory_region' "
        "parameter for tensor '{}'",
    ),
]


@pytest.mark.parametrize(("given", "text"), _TRITON_SHM_ANSWERS)
def test_shared_memory_parameters_triton_refuses_get_its_texts(
    given: dict[str, tuple[str, object]], text: str
) -> None:
    """Of an input and of a requested output, as Triton's ``ParseSharedMemoryParams``."""
    request = _request()
    _shm(request.inputs.add(name="A", datatype="FP32", shape=[1]).parameters, given)
    with pytest.raises(InvalidInput) as info:
        request_document(request)
    assert info.value.message == text.format("A")
    request = _request()
    request.inputs.add(name="A", datatype="FP32", shape=[1])
    request.raw_input_contents.append(b"aaaa")
    _shm(request.outputs.add(name="OUT").parameters, given)
    with pytest.raises(InvalidInput) as info:
        request_document(request)
    assert info.value.message == text.format("OUT")


def test_shared_memory_parameters_in_tritons_kinds_are_taken() -> None:
    request = _request()
    given = {_REGION: ("string_param", "r"), _OFFSET: ("int64_param", 8), _SIZE: ("int64_param", 4)}
    _shm(request.inputs.add(name="A", datatype="FP32", shape=[1]).parameters, given)
    _shm(request.outputs.add(name="OUT").parameters, given)
    document, _ = request_document(request)
    expected = {_REGION: "r", _OFFSET: 8, _SIZE: 4}
    assert document["inputs"][0]["parameters"] == expected
    assert document["outputs"][0]["parameters"] == expected


def test_a_triton_parameter_triton_does_not_read_gets_its_text() -> None:
    request = _request()
    request.inputs.add(name="A", datatype="FP32", shape=[1])
    request.raw_input_contents.append(b"aaaa")
    request.parameters["triton_enable_empty_final_response"].bool_param = True
    assert request_document(request)[0]["parameters"] == {
        "triton_enable_empty_final_response": True
    }
    request.parameters["triton_other"].bool_param = True
    with pytest.raises(InvalidInput) as info:
        request_document(request)
    assert info.value.message == (
        "parameter keys starting with 'triton_' are reserved for Triton usage. Only the "
        "following keys starting with 'triton_' are allowed: triton_enable_empty_final_response"
    )
