"""A response's own parameters (an ensemble's sequence flags) on HTTP and gRPC, read back
by tritonclient's parsers as Triton's are."""

from __future__ import annotations

import numpy as np
import tritonclient.http as httpclient
from tritonclient.grpc import service_pb2

from sluice.core.datatypes import to_buffer
from sluice.gateway.grpc_api.tensors import encode_response
from sluice.gateway.inference.response import OutputTensor, encode_infer_response

PARAMETERS = {"sequence_id": "s-1", "sequence_start": True, "sequence_end": False, "n": -4}


def _output() -> OutputTensor:
    array = np.array([1.0, 2.0], np.float32)
    return OutputTensor("OUT", "FP32", (2,), to_buffer("FP32", array))


def test_http_responses_carry_the_parameters() -> None:
    body, length = encode_infer_response(
        model_name="ens",
        model_version="1",
        request_id="",
        outputs=[_output()],
        binary=[True],
        parameters=PARAMETERS,
    )
    result = httpclient.InferenceServerClient.parse_response_body(body, header_length=length)
    assert result.get_response()["parameters"] == PARAMETERS
    np.testing.assert_array_equal(result.as_numpy("OUT"), [1.0, 2.0])
    plain, _ = encode_infer_response(
        model_name="m", model_version="1", request_id="", outputs=[], binary=[]
    )
    assert b"parameters" not in plain


def test_grpc_responses_carry_the_parameters_typed() -> None:
    response = service_pb2.ModelInferResponse.FromString(
        encode_response("ens", "1", "r", [_output()], PARAMETERS)
    )
    parameters = response.parameters
    assert parameters["sequence_id"].string_param == "s-1"
    assert parameters["sequence_start"].bool_param is True
    assert parameters["sequence_end"].WhichOneof("parameter_choice") == "bool_param"
    assert parameters["n"].int64_param == -4
    assert not service_pb2.ModelInferResponse.FromString(
        encode_response("m", "1", "r", [_output()])
    ).parameters
