"""Hostile ``ModelInferRequest`` messages against a running Sluice, over gRPC: reserved
parameters and class counts of a kind Triton refuses, messages of nothing but empty
entries, and errors whose text would outgrow a gRPC trailer.

The expected texts are Triton's own (server ``src/grpc/infer_handler.cc``,
``src/grpc/grpc_utils.cc``). The memory these messages may take is
``tests/integration/test_grpc_limits.py``'s.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from tests.support.stack import Stack

IRIS = np.array([[5.1, 3.5, 1.4, 0.2], [6.7, 3.0, 5.2, 2.3]], dtype=np.float32)
CLASS = re.compile(rb"^\d+\.\d{6}:\d:(setosa|versicolor|virginica)$")


@pytest.fixture
def stub(stack: Stack) -> Iterator[Any]:
    with grpc.insecure_channel(stack.grpc_address) as channel:
        yield service_pb2_grpc.GRPCInferenceServiceStub(channel)


def iris_request(shape: tuple[int, ...] = (2, 4)) -> Any:
    request = service_pb2.ModelInferRequest(model_name="iris", id="hostile")
    request.inputs.add(name="input", datatype="FP32", shape=list(shape))
    request.raw_input_contents.append(IRIS.tobytes())
    return request


def refused(call: Any, request: Any) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call(request, timeout=60)
    return info.value.code(), info.value.details() or ""


TYPE = "invalid value type for '{}' parameter, expected {}."


@pytest.mark.parametrize(
    ("name", "kind", "value", "text"),
    [
        (
            "sequence_id",
            "uint64_param",
            5,
            TYPE.format("sequence_id", "int64_param or string_param"),
        ),
        (
            "sequence_id",
            "bool_param",
            True,
            TYPE.format("sequence_id", "int64_param or string_param"),
        ),
        ("sequence_start", "int64_param", 1, TYPE.format("sequence_start", "bool_param")),
        ("sequence_end", "string_param", "true", TYPE.format("sequence_end", "bool_param")),
        ("priority", "double_param", 1.0, TYPE.format("priority", "int64_param or uint64_param")),
        ("priority", "int64_param", -1, "invalid value for 'priority', expected value >= 0."),
        ("timeout", "uint64_param", 10**6, TYPE.format("timeout", "int64_param")),
        (
            "triton_enable_empty_final_response",
            "int64_param",
            1,
            TYPE.format("triton_enable_empty_final_response", "bool_param"),
        ),
    ],
)
def test_a_reserved_parameter_of_another_kind_gets_tritons_answer(
    stub: Any, name: str, kind: str, value: Any, text: str
) -> None:
    """For every model (iris is no sequence model), as Triton's gRPC frontend checks them."""
    request = iris_request()
    setattr(request.parameters[name], kind, value)
    assert refused(stub.ModelInfer, request) == (grpc.StatusCode.INVALID_ARGUMENT, text)


def test_a_triton_parameter_triton_does_not_read_gets_its_answer(stub: Any) -> None:
    request = iris_request()
    request.parameters["triton_anything"].bool_param = True
    assert refused(stub.ModelInfer, request) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "parameter keys starting with 'triton_' are reserved for Triton usage. Only the "
        "following keys starting with 'triton_' are allowed: triton_enable_empty_final_response",
    )


@pytest.mark.parametrize(
    ("name", "kind", "value", "expected"),
    [
        ("shared_memory_region", "int64_param", 1, "string_param"),
        ("shared_memory_offset", "string_param", "0", "int64_param"),
        ("shared_memory_offset", "uint64_param", 0, "int64_param"),
        ("shared_memory_byte_size", "uint64_param", 32, "int64_param"),
    ],
)
def test_shared_memory_parameters_of_another_kind_get_tritons_answer(
    stub: Any, name: str, kind: str, value: Any, expected: str
) -> None:
    """Of an input and of a requested output, before any region is looked up."""
    for tensor in ("input", "probabilities"):
        request = service_pb2.ModelInferRequest(model_name="iris", id="hostile")
        request.inputs.add(name="input", datatype="FP32", shape=[2, 4])
        parameters = (
            request.inputs[0].parameters
            if tensor == "input"
            else request.outputs.add(name=tensor).parameters
        )
        if tensor != "input":
            request.raw_input_contents.append(IRIS.tobytes())
        parameters["shared_memory_region"].string_param = "unregistered"
        parameters["shared_memory_byte_size"].int64_param = 32
        setattr(parameters[name], kind, value)
        assert refused(stub.ModelInfer, request) == (
            grpc.StatusCode.INVALID_ARGUMENT,
            f"invalid value type for '{name}' parameter for tensor '{tensor}', "
            f"expected {expected}.",
        )


def test_reserved_parameters_of_their_own_kinds_are_taken(stub: Any) -> None:
    request = iris_request()
    request.parameters["sequence_id"].int64_param = -1  # (Triton's core: 2^64-1)
    request.parameters["sequence_start"].bool_param = True
    request.parameters["priority"].uint64_param = 1
    request.parameters["timeout"].int64_param = 10**7
    request.parameters["custom"].double_param = 0.5
    answer = stub.ModelInfer(request, timeout=60)
    assert answer.id == "hostile" and [o.name for o in answer.outputs] == ["label", "probabilities"]


@pytest.mark.parametrize(
    ("kind", "value", "text"),
    [
        ("int64_param", 0, "invalid value for 'classification' parameter, expected >= 1"),
        ("int64_param", -2, "invalid value for 'classification' parameter, expected >= 1"),
        (
            "uint64_param",
            2,
            "invalid value type for 'classification' parameter, expected int64_param",
        ),
        (
            "string_param",
            "2",
            "invalid value type for 'classification' parameter, expected int64_param",
        ),
    ],
)
def test_a_class_count_triton_refuses_is_refused(
    stub: Any, kind: str, value: Any, text: str
) -> None:
    request = iris_request()
    setattr(request.outputs.add(name="probabilities").parameters["classification"], kind, value)
    assert refused(stub.ModelInfer, request) == (grpc.StatusCode.INVALID_ARGUMENT, text)


def test_class_counts_over_grpc_answer_as_over_rest(stack: Stack) -> None:
    outputs = [grpcclient.InferRequestedOutput("probabilities", class_count=5)]
    tensor = grpcclient.InferInput("input", list(IRIS.shape), "FP32")
    tensor.set_data_from_numpy(IRIS)
    with grpcclient.InferenceServerClient(stack.grpc_address) as client:
        classes = client.infer("iris", [tensor], outputs=outputs).as_numpy("probabilities")
        with pytest.raises(InferenceServerException) as info:
            client.infer(
                "iris",
                [tensor],
                outputs=[grpcclient.InferRequestedOutput("probabilities", class_count=1 << 32)],
            )
    assert info.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "must be an unsigned 32-bit integer" in str(info.value.message())
    assert classes.shape == (2, 3)  # min(5, the three classes)
    assert all(CLASS.match(element) for element in classes.reshape(-1)), classes
    rest_tensor = httpclient.InferInput("input", list(IRIS.shape), "FP32")
    rest_tensor.set_data_from_numpy(IRIS)
    with httpclient.InferenceServerClient(stack.address) as rest:
        rest_outputs = [httpclient.InferRequestedOutput("probabilities", class_count=5)]
        same = rest.infer("iris", [rest_tensor], outputs=rest_outputs).as_numpy("probabilities")
    assert classes.tolist() == same.tolist()


def test_messages_of_empty_entries_are_refused_before_they_are_decoded(stack: Stack) -> None:
    """Two bytes an entry on the wire, some forty times that once decoded: refused after
    counting, on a call and on a stream (with the request's id)."""
    entries = 500_000
    for field, name, limit in (
        (5, "inputs", 256),
        (6, "outputs", 4096),
        (7, "raw_input_contents", 256),
    ):
        message = iris_request().SerializeToString() + bytes([(field << 3) | 2, 0]) * entries
        text = f"request '{name}' has more entries than the limit of {limit}"
        with grpc.insecure_channel(stack.grpc_address) as channel:
            infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
            with pytest.raises(grpc.RpcError) as info:
                infer(message, timeout=60)
            assert (info.value.code(), info.value.details()) == (
                grpc.StatusCode.INVALID_ARGUMENT,
                text,
            )
            stream = channel.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer")
            [raw] = list(stream(iter([message]), timeout=60))
        answer = service_pb2.ModelStreamInferResponse.FromString(raw)
        assert (answer.error_message, answer.infer_response.id) == (text, "hostile")


def test_a_shape_of_more_dims_than_any_tensor_has_is_not_read(stub: Any) -> None:
    request = iris_request(shape=(2, *[1] * 100_000, 4))
    assert refused(stub.ModelInfer, request) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "input 'input': 'shape' has 100002 dims, more than the limit of 64",
    )


def test_an_error_that_echoes_a_long_name_still_reaches_the_client(stub: Any, stack: Stack) -> None:
    """Percent-encoded, these texts would pass the 16 KiB gRPC clients take in a trailer:
    they are cut instead, so the client gets the error's own code."""
    request = iris_request(shape=(2, 3))
    request.id = "é" * 3000
    code, details = refused(stub.ModelInfer, request)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details.startswith("[request id: éé") and details.endswith(" more characters)")
    with (
        grpcclient.InferenceServerClient(stack.grpc_address) as client,
        pytest.raises(InferenceServerException) as info,
    ):
        client.get_model_metadata("m" * 20_000)
    assert info.value.status() == "StatusCode.NOT_FOUND"
    assert str(info.value.message()).startswith("Request for unknown model: 'mmm")
