"""gRPC requests turned into the REST path's form, and answers into ModelInferResponse."""

from __future__ import annotations

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
    document, _ = request_document(request)
    assert document["parameters"] == {
        "sequence_id": (1 << 64) - 2,
        "priority": 3,
        "custom": (1 << 64) - 1,
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
