"""Triton's --http-header-forward-pattern and --grpc-header-forward-pattern on a real stack:
the model reads the matching headers (HTTP) and metadata (gRPC) as string request
parameters, through tritonclient as through a plain client; the API key never reaches it;
a forwarded reserved name is a 400."""

from __future__ import annotations

import json
import queue
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from sluice.scheduler.executor.redis_server import RedisServer
from tests.support.model_files import python_config, tensor, write_model
from tests.support.stack import Stack

PARAMETERS = """
import json
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            seen = json.loads(request.parameters())
            keys = np.array([k.encode() for k in seen], dtype=object)
            values = np.array([json.dumps(v).encode() for v in seen.values()], dtype=object)
            responses.append(
                pb_utils.InferenceResponse(
                    [pb_utils.Tensor("key", keys), pb_utils.Tensor("value", values)],
                    parameters={"seen": len(seen), "model": "parameter", "ok": True},
                )
            )
        return responses
"""


CALLER = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            call = pb_utils.InferenceRequest(
                model_name="parameter",
                inputs=[pb_utils.get_input_tensor_by_name(request, "INPUT0")],
                requested_output_names=["key", "value"],
                parameters={"from_bls": "yes", "count": 2},
            )
            answer = call.exec()
            if answer.has_error():
                raise pb_utils.TritonModelException(answer.error().message())
            # The called model's response parameters, passed on with a name of its own.
            responses.append(
                pb_utils.InferenceResponse(
                    answer.output_tensors(),
                    parameters={"called": answer.parameters()},
                )
            )
        return responses
"""
"""Calls ``parameter`` with parameters of its own (BLS), as Triton's models may."""

STREAMER = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            for index in range(2):
                keys = np.array([b"index"], dtype=object)
                values = np.array([str(index).encode()], dtype=object)
                sender.send(
                    pb_utils.InferenceResponse(
                        [pb_utils.Tensor("key", keys), pb_utils.Tensor("value", values)],
                        parameters={"index": index},
                    )
                )
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""
"""A decoupled model whose every response carries its index as a parameter."""

ENSEMBLE = """
platform: "ensemble"
max_batch_size: 0
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [
  { name: "key" data_type: TYPE_STRING dims: [ -1 ] },
  { name: "value" data_type: TYPE_STRING dims: [ -1 ] }
]
ensemble_scheduling {
  step [
    {
      model_name: "parameter"
      model_version: -1
      input_map { key: "INPUT0" value: "INPUT0" }
      output_map [ { key: "key" value: "key" }, { key: "value" value: "value" } ]
    }
  ]
}
"""
"""As Triton's: the ensemble's request parameters reach each step."""


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("forwarding")
    config = python_config(
        [tensor("INPUT0", "TYPE_FP32", "1")],
        [tensor("key", "TYPE_STRING", "-1"), tensor("value", "TYPE_STRING", "-1")],
        max_batch_size=0,
    )
    write_model(root, "parameter", config, {"1/model.py": PARAMETERS})
    write_model(root, "ensemble", ENSEMBLE, {"1/.keep": ""})
    write_model(root, "caller", config, {"1/model.py": CALLER})
    decoupled = config + "model_transaction_policy { decoupled: true }\n"
    write_model(root, "streamer", decoupled, {"1/model.py": STREAMER})
    args = [
        "--http-header-forward-pattern=(my_header.*|priority|authorization)",
        "--grpc-header-forward-pattern",
        "(?-i)my_header_[12]",
    ]
    env = {"SLUICE_API_KEYS": "team-a:key-a"}
    started = Stack(root, redis_server.url, env=env, args=args)
    started.start()
    yield started
    started.stop()


def _seen(result: httpclient.InferResult | grpcclient.InferResult) -> dict[str, object]:
    keys = [k.decode() for k in result.as_numpy("key").reshape(-1)]
    values = [json.loads(v) for v in result.as_numpy("value").reshape(-1)]
    return dict(zip(keys, values, strict=True))


HEADERS = {
    "my_header_1": "my_value_1",
    "my_header_2": 'a "quoted" string with a backslash\\',
    "my_header_3": "three",
    "header_4": "four",
    "Authorization": "Bearer key-a",
}


@pytest.mark.parametrize("model", ["parameter", "ensemble"])
def test_http_headers_that_match_reach_the_model_as_string_parameters(
    stack: Stack, model: str
) -> None:
    client = httpclient.InferenceServerClient(stack.address)
    try:
        tensor_in = httpclient.InferInput("INPUT0", [1], "FP32")
        tensor_in.set_data_from_numpy(np.array([1.0], dtype=np.float32))
        # (a copy: tritonclient.http adds its own headers to the dict it is given)
        result = client.infer(
            model, [tensor_in], parameters={"key1": 7, "flag": True}, headers=dict(HEADERS)
        )
    finally:
        client.close()
    assert _seen(result) == {
        "key1": 7,
        "flag": True,
        "my_header_1": "my_value_1",
        "my_header_2": 'a "quoted" string with a backslash\\',
        "my_header_3": "three",
    }


def test_grpc_metadata_that_matches_case_sensitively_reaches_the_model(stack: Stack) -> None:
    client = grpcclient.InferenceServerClient(stack.grpc_address)
    try:
        tensor_in = grpcclient.InferInput("INPUT0", [1], "FP32")
        tensor_in.set_data_from_numpy(np.array([1.0], dtype=np.float32))
        headers = {k.lower(): v for k, v in HEADERS.items()}
        result = client.infer("parameter", [tensor_in], headers=headers)
    finally:
        client.close()
    assert _seen(result) == {
        "my_header_1": "my_value_1",
        "my_header_2": 'a "quoted" string with a backslash\\',
    }
    # The model's response parameters reach the client, as in Triton.
    parameters = result.get_response().parameters
    assert parameters["seen"].int64_param == 2 and parameters["ok"].bool_param
    assert parameters["model"].string_param == "parameter"


def test_a_forwarded_reserved_name_is_refused(stack: Stack) -> None:
    body = {"inputs": [{"name": "INPUT0", "shape": [1], "datatype": "FP32", "data": [1.0]}]}
    headers = {"Authorization": "Bearer key-a", "priority": "1"}
    answer = httpx.post(f"{stack.url}/v2/models/parameter/infer", json=body, headers=headers)
    assert answer.status_code == 400, answer.text
    assert "reserved for Triton usage" in answer.json()["error"]


def test_a_bls_request_carries_its_own_parameters(stack: Stack) -> None:
    client = httpclient.InferenceServerClient(stack.address)
    try:
        tensor_in = httpclient.InferInput("INPUT0", [1], "FP32")
        tensor_in.set_data_from_numpy(np.array([1.0], dtype=np.float32))
        result = client.infer("caller", [tensor_in], headers={"Authorization": "Bearer key-a"})
    finally:
        client.close()
    assert _seen(result) == {"from_bls": "yes", "count": 2}
    called = json.loads(result.get_response()["parameters"]["called"])
    assert called == {"seen": 2, "model": "parameter", "ok": True}


def test_a_decoupled_models_responses_carry_their_parameters(stack: Stack) -> None:
    answers: queue.Queue[Any] = queue.Queue()
    client = grpcclient.InferenceServerClient(stack.grpc_address)
    try:
        client.start_stream(
            callback=lambda result, error: answers.put((result, error)),
            headers={"authorization": "Bearer key-a"},
        )
        tensor_in = grpcclient.InferInput("INPUT0", [1], "FP32")
        tensor_in.set_data_from_numpy(np.array([1.0], dtype=np.float32))
        client.async_stream_infer("streamer", [tensor_in])
        indexes = []
        for _ in range(2):
            result, error = answers.get(timeout=30)
            assert error is None, error
            indexes.append(result.get_response().parameters["index"].int64_param)
        assert indexes == [0, 1]
    finally:
        client.stop_stream()
        client.close()
