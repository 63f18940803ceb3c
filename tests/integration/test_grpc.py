"""Triton's gRPC client (``tritonclient.grpc`` and ``.aio``), unchanged, against a running
Sluice: every call of ``inference.GRPCInferenceService``, answers equal to REST's, errors
with Triton's status codes and texts, the bidirectional stream, health and reflection.

Issue 13. The shared stack serves gRPC on its own free port beside HTTP.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Iterator
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aioclient
import tritonclient.http as httpclient
from google.protobuf import json_format
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from tests.integration.test_tritonclient import sample
from tests.support.onnx_models import ALL_DATATYPES
from tests.support.stack import Stack

IRIS = np.array([[5.1, 3.5, 1.4, 0.2], [6.7, 3.0, 5.2, 2.3]], dtype=np.float32)


@pytest.fixture
def client(stack: Stack) -> Iterator[grpcclient.InferenceServerClient]:
    with grpcclient.InferenceServerClient(stack.grpc_address) as client:
        yield client


@pytest.fixture
def rest(stack: Stack) -> Iterator[httpclient.InferenceServerClient]:
    with httpclient.InferenceServerClient(stack.address) as client:
        yield client


@pytest.fixture
def stub(stack: Stack) -> Iterator[Any]:
    """The generated stub itself, for requests tritonclient would not send."""
    with grpc.insecure_channel(stack.grpc_address) as channel:
        yield service_pb2_grpc.GRPCInferenceServiceStub(channel)


def iris_input(module: Any = grpcclient) -> Any:
    tensor = module.InferInput("input", list(IRIS.shape), "FP32")
    tensor.set_data_from_numpy(IRIS)
    return tensor


def rejected(call: Any, code: str, *fragments: str) -> str:
    with pytest.raises(InferenceServerException) as info:
        call()
    message = str(info.value.message())
    assert info.value.status() == f"StatusCode.{code}", message
    for fragment in fragments:
        assert fragment in message, message
    return message


def as_dict(message: Any) -> dict[str, Any]:
    return json_format.MessageToDict(message, preserving_proto_field_name=True)


# -- health, metadata, configuration ---------------------------------------------------


def test_health_metadata_and_config_equal_rest(
    client: grpcclient.InferenceServerClient, rest: httpclient.InferenceServerClient
) -> None:
    assert client.is_server_live()
    assert client.is_server_ready() == rest.is_server_ready()
    assert client.is_model_ready("iris") and client.is_model_ready("iris", "1")
    assert not client.is_model_ready("no_such_model")
    assert not client.is_model_ready("corrupt_model")

    server = as_dict(client.get_server_metadata())
    assert server == rest.get_server_metadata()

    for model in ("iris", "identity", "nobatch"):
        grpc_metadata = as_dict(client.get_model_metadata(model))
        rest_metadata = rest.get_model_metadata(model)
        for tensors in ("inputs", "outputs"):
            for tensor in rest_metadata[tensors]:  # protobuf's JSON writes int64 as strings
                tensor["shape"] = [str(dim) for dim in tensor["shape"]]
        assert grpc_metadata == rest_metadata

    config = client.get_model_config("iris").config
    assert config.name == "iris" and config.max_batch_size == 64
    assert config.dynamic_batching.max_queue_delay_microseconds == 500
    rest_config = rest.get_model_config("iris")
    assert as_dict(config)["input"][0]["name"] == rest_config["input"][0]["name"]

    rejected(lambda: client.get_model_metadata("no_such_model"), "NOT_FOUND", "no_such_model")
    rejected(lambda: client.get_model_config("iris", "7"), "NOT_FOUND")


def test_statistics_and_repository_index(client: grpcclient.InferenceServerClient) -> None:
    client.infer("iris", [iris_input()])
    stats = client.get_inference_statistics("iris").model_stats[0]
    assert stats.name == "iris" and stats.version == "1"
    assert stats.inference_count >= 2 and stats.execution_count >= 1
    assert stats.inference_stats.success.count >= 1
    everything = client.get_inference_statistics().model_stats
    assert {"iris", "identity"} <= {row.name for row in everything}

    index = {row.name: row for row in client.get_model_repository_index().models}
    assert index["iris"].state == "READY" and index["iris"].version == "1"
    assert index["broken_config"].state == "UNAVAILABLE"
    assert "max_batch_size" in index["broken_config"].reason


def test_load_and_unload_answer_as_triton_without_explicit_mode(
    client: grpcclient.InferenceServerClient,
) -> None:
    message = rejected(lambda: client.load_model("iris"), "UNAVAILABLE")
    assert "explicit model load / unload is not allowed if polling is enabled" in message
    rejected(lambda: client.unload_model("iris"), "UNAVAILABLE", "not allowed")


def test_log_and_trace_settings(client: grpcclient.InferenceServerClient) -> None:
    settings = as_dict(client.get_log_settings())["settings"]
    assert settings["log_info"] == {"bool_param": True}
    changed = as_dict(client.update_log_settings({"log_verbose_level": 1}))["settings"]
    assert changed["log_verbose_level"] == {"uint32_param": 1}
    client.update_log_settings({"log_verbose_level": 0})
    rejected(
        lambda: client.update_log_settings({"log_format": "xml"}),
        "INVALID_ARGUMENT",
        "invalid argument for --log_format, got: xml",
    )

    trace = as_dict(client.get_trace_settings())["settings"]
    assert trace["trace_level"] == {"value": ["OFF"]}
    assert as_dict(client.get_trace_settings(model_name="iris")) == as_dict(
        client.get_trace_settings()
    )
    rejected(
        lambda: client.update_trace_settings(settings={"trace_rate": "2"}),
        "UNIMPLEMENTED",
        "trace settings can not be updated",
    )
    rejected(lambda: client.get_trace_settings(model_name="no_such_model"), "NOT_FOUND")


def test_trace_settings_over_rest(stack: Stack) -> None:
    """The same extension at ``/v2[/models/{m}]/trace/setting``, with its bad inputs."""
    with httpx.Client(base_url=stack.url, timeout=10) as http:
        settings = http.get("/v2/trace/setting")
        assert settings.status_code == 200 and settings.json()["trace_level"] == ["OFF"]
        assert http.get("/v2/models/iris/trace/setting").json() == settings.json()
        assert http.post("/v2/trace/setting", content=b"").json() == settings.json()
        changed = http.post("/v2/trace/setting", json={"trace_rate": "2"})
        assert changed.status_code == 501, changed.text
        assert "trace settings can not be updated" in changed.json()["error"]
        assert http.post("/v2/trace/setting", content=b"{not json").status_code == 400
        unknown = http.get("/v2/models/no_such_model/trace/setting")
        assert unknown.status_code == 404 and "no_such_model" in unknown.json()["error"]


# -- inference -----------------------------------------------------------------------


def test_iris_answers_equal_rest(
    client: grpcclient.InferenceServerClient, rest: httpclient.InferenceServerClient
) -> None:
    result = client.infer("iris", [iris_input()], request_id="req-7")
    rest_result = rest.infer("iris", [iris_input(httpclient)])
    response = result.get_response()
    assert response.id == "req-7" and response.model_name == "iris"
    assert response.model_version == "1"
    for name in ("label", "probabilities"):
        np.testing.assert_array_equal(result.as_numpy(name), rest_result.as_numpy(name))
    only = client.infer("iris", [iris_input()], outputs=[grpcclient.InferRequestedOutput("label")])
    assert [output.name for output in only.get_response().outputs] == ["label"]


def test_every_datatype_round_trips(client: grpcclient.InferenceServerClient) -> None:
    inputs, expected = [], {}
    for datatype in [dt for dt in ALL_DATATYPES if dt != "BF16"]:
        array = sample(datatype, (3, 5))
        tensor = grpcclient.InferInput(f"IN_{datatype}", list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
        expected[f"OUT_{datatype}"] = array
    result = client.infer("identity", inputs)
    for name, array in expected.items():
        got = result.as_numpy(name)
        assert got is not None and got.shape == array.shape, name
        if array.dtype == np.object_:
            assert [bytes(v) for v in got.flat] == [bytes(v) for v in array.flat], name
        else:
            np.testing.assert_array_equal(got, array, err_msg=name)
    assert (
        client.infer("nobatch", [_fp32("IN_FP32", np.ones((2, 3)))]).as_numpy("OUT_FP32").tolist()
        == [[1.0] * 3] * 2
    )


def _fp32(name: str, array: np.ndarray) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput(name, list(array.shape), "FP32")
    tensor.set_data_from_numpy(array.astype(np.float32))
    return tensor


def _typed_request(model: str, name: str, datatype: str, shape: list[int]) -> Any:
    request = service_pb2.ModelInferRequest(model_name=model, id="typed")
    request.inputs.add(name=name, datatype=datatype, shape=shape)
    return request


def test_typed_contents_are_read_as_triton_reads_them(stub: Any) -> None:
    """Typed ``contents`` (what clients without raw tensors send), and Triton's texts when
    they do not fit (the narrowing of INT8 and the BYTES layout: tests/unit/test_grpc_tensors)."""
    request = _typed_request("nobatch", "IN_FP32", "FP32", [2, 3])
    request.inputs[0].contents.fp32_contents.extend([1, 2, 3, 4, 5, 6])
    response = stub.ModelInfer(request)
    assert response.id == "typed"
    assert np.frombuffer(response.raw_output_contents[0], np.float32).tolist() == [1, 2, 3, 4, 5, 6]

    wrong = _typed_request("nobatch", "IN_FP32", "FP32", [2, 3])
    wrong.inputs[0].contents.int_contents.extend([1, 2, 3, 4, 5, 6])
    _assert_grpc_error(
        stub,
        wrong,
        "INVALID_ARGUMENT",
        "unexpected explicit tensor data for input tensor 'IN_FP32' for model 'nobatch' of "
        "type 'INT32', expected datatype 'FP32'",
    )
    short = _typed_request("nobatch", "IN_FP32", "FP32", [2, 3])
    short.inputs[0].contents.fp32_contents.extend([1, 2])
    _assert_grpc_error(
        stub,
        short,
        "INVALID_ARGUMENT",
        "input byte size mismatch for input 'IN_FP32' for model 'nobatch'. Expected 24, got 8",
    )
    both = _typed_request("nobatch", "IN_FP32", "FP32", [2, 3])
    both.inputs[0].contents.fp32_contents.extend([1] * 6)
    both.raw_input_contents.append(np.ones(6, np.float32).tobytes())
    _assert_grpc_error(
        stub,
        both,
        "INVALID_ARGUMENT",
        "contents field must not be specified when using raw_input_contents for 'IN_FP32' "
        "for model 'nobatch'",
    )
    missing = _typed_request("nobatch", "IN_FP32", "FP32", [2, 3])
    _assert_grpc_error(
        stub,
        missing,
        "INVALID_ARGUMENT",
        "unable to find data for input tensor 'IN_FP32' for model 'nobatch' in request.",
    )
    extra = _typed_request("nobatch", "IN_FP32", "FP32", [2, 3])
    extra.raw_input_contents.extend([np.ones(6, np.float32).tobytes(), b"more"])
    _assert_grpc_error(stub, extra, "INVALID_ARGUMENT", "unexpected additional input data")


def _assert_grpc_error(stub: Any, request: Any, code: str, fragment: str) -> None:
    with pytest.raises(grpc.RpcError) as info:
        stub.ModelInfer(request)
    assert info.value.code() == grpc.StatusCode[code], info.value.details()
    assert fragment in info.value.details(), info.value.details()


def test_errors_carry_tritons_codes_and_texts(
    client: grpcclient.InferenceServerClient, rest: httpclient.InferenceServerClient
) -> None:
    rejected(
        lambda: client.infer("no_such_model", [iris_input()]),
        "NOT_FOUND",
        "Request for unknown model: 'no_such_model' is not found",
    )
    wrong = grpcclient.InferInput("input", [2, 3], "FP32")
    wrong.set_data_from_numpy(np.zeros((2, 3), np.float32))
    message = rejected(
        lambda: client.infer("iris", [wrong], request_id="r1"),
        "INVALID_ARGUMENT",
        "[request id: r1] unexpected shape for input 'input' for model 'iris'",
    )
    rest_wrong = httpclient.InferInput("input", [2, 3], "FP32")
    rest_wrong.set_data_from_numpy(np.zeros((2, 3), np.float32))
    with pytest.raises(InferenceServerException) as info:
        rest.infer("iris", [rest_wrong], request_id="r1")
    assert info.value.message() == message  # the same text on both wires
    # A model whose load failed: Triton's NOT_FOUND without a version, UNAVAILABLE for one
    # it tried.
    rejected(
        lambda: client.infer("corrupt_model", [_fp32("IN_FP32", np.ones((1, 2)))]),
        "NOT_FOUND",
        "Request for unknown model: 'corrupt_model' has no available versions",
    )
    rejected(
        lambda: client.infer(
            "corrupt_model", [_fp32("IN_FP32", np.ones((1, 2)))], model_version="1"
        ),
        "UNAVAILABLE",
        "Request for unknown model: 'corrupt_model' version 1 is not at ready state",
    )
    rejected(lambda: client.infer("iris", [iris_input()], model_version="9"), "NOT_FOUND")


def test_gzip_requests_and_priorities(client: grpcclient.InferenceServerClient) -> None:
    big = np.arange(64 * 4, dtype=np.float32).reshape(64, 4)
    tensor = grpcclient.InferInput("input", list(big.shape), "FP32")
    tensor.set_data_from_numpy(big)
    result = client.infer("iris", [tensor], compression_algorithm="gzip", priority=1)
    assert result.as_numpy("label").shape == (64, 1)
    result = client.infer("iris", [iris_input()], timeout=5_000_000)
    assert result.as_numpy("label").tolist() == [[0], [2]]


def test_a_message_past_the_receive_limit_is_refused(stack: Stack) -> None:
    """The stack's gRPC limit is the default, its ``SLUICE_MAX_BODY_BYTES`` (1 MiB); a larger
    message is refused by gRPC itself before any of it is decoded."""
    with grpcclient.InferenceServerClient(
        stack.grpc_address,
        channel_args=[("grpc.max_send_message_length", 1 << 30)],
    ) as client:
        huge = np.zeros((1, 17 * 1024 * 1024), np.float32)  # 68 MiB
        tensor = grpcclient.InferInput("IN_FP32", list(huge.shape), "FP32")
        tensor.set_data_from_numpy(huge)
        rejected(lambda: client.infer("identity", [tensor]), "RESOURCE_EXHAUSTED")
        assert client.is_server_live()


def test_deadline_of_the_client_caps_the_request(client: grpcclient.InferenceServerClient) -> None:
    """The identity model waits 20 ms for a batch to fill: longer than the deadline."""
    inputs = []
    for datatype in [dt for dt in ALL_DATATYPES if dt != "BF16"]:
        tensor = grpcclient.InferInput(f"IN_{datatype}", [1, 2], datatype)
        tensor.set_data_from_numpy(sample(datatype, (1, 2)))
        inputs.append(tensor)
    rejected(lambda: client.infer("identity", inputs, client_timeout=0.005), "DEADLINE_EXCEEDED")
    assert client.infer("iris", [iris_input()], client_timeout=10).as_numpy("label") is not None


# -- streaming -------------------------------------------------------------------------


def test_stream_answers_every_request_once_across_concurrent_streams(stack: Stack) -> None:
    """Three streams at once, 1,000 requests each, every answer matched to its id."""
    per_stream, streams = 1000, 3
    failures: list[str] = []

    def one_stream(index: int) -> None:
        answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
        with grpcclient.InferenceServerClient(stack.grpc_address) as client:
            client.start_stream(callback=lambda result, error: answers.put((result, error)))
            for number in range(per_stream):
                value = np.array([[number, index, 0, 1]], dtype=np.float32)
                tensor = grpcclient.InferInput("input", [1, 4], "FP32")
                tensor.set_data_from_numpy(value)
                client.async_stream_infer("iris", [tensor], request_id=f"{index}-{number}")
            seen: set[str] = set()
            for _ in range(per_stream):
                result, error = answers.get(timeout=60)
                if error is not None:
                    failures.append(str(error))
                    continue
                request_id = result.get_response().id
                if request_id in seen:
                    failures.append(f"duplicate {request_id}")
                seen.add(request_id)
            client.stop_stream()
            if seen != {f"{index}-{number}" for number in range(per_stream)}:
                failures.append(f"stream {index}: {per_stream - len(seen)} answers missing")
            if not answers.empty():
                failures.append(f"stream {index}: answers beyond the requests")

    threads = [threading.Thread(target=one_stream, args=(i,)) for i in range(streams)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert failures == []


def test_a_failed_stream_request_answers_its_error_and_the_stream_goes_on(
    client: grpcclient.InferenceServerClient,
) -> None:
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    wrong = grpcclient.InferInput("input", [1, 3], "FP32")
    wrong.set_data_from_numpy(np.zeros((1, 3), np.float32))
    client.async_stream_infer("iris", [wrong], request_id="bad")
    client.async_stream_infer("no_such_model", [iris_input()], request_id="unknown")
    client.async_stream_infer("iris", [iris_input()], request_id="good")
    got = [answers.get(timeout=10) for _ in range(3)]
    client.stop_stream()
    errors = sorted(str(error) for result, error in got if error is not None)
    assert len(errors) == 2
    assert any("[request id: bad] unexpected shape" in error for error in errors)
    assert any("Request for unknown model: 'no_such_model'" in error for error in errors)
    good = [result for result, error in got if error is None]
    assert [result.get_response().id for result in good] == ["good"]


def test_aio_client_calls_and_stream(stack: Stack) -> None:
    async def run() -> None:
        async with aioclient.InferenceServerClient(stack.grpc_address) as client:
            assert await client.is_server_live()
            assert await client.is_model_ready("iris")
            metadata = await client.get_model_metadata("iris", as_json=True)
            assert metadata["platform"] == "onnxruntime_onnx"
            result = await client.infer("iris", [iris_input(aioclient)])
            assert result.as_numpy("label").tolist() == [[0], [2]]

            async def requests() -> Any:
                for number in range(50):
                    yield {
                        "model_name": "iris",
                        "inputs": [iris_input(aioclient)],
                        "request_id": str(number),
                    }

            ids = []
            async for result, error in client.stream_infer(requests()):
                assert error is None, error
                ids.append(result.get_response().id)
            assert sorted(ids, key=int) == [str(n) for n in range(50)]

    asyncio.run(run())


# -- health protocol and reflection ----------------------------------------------------


def test_grpc_health_and_reflection(stack: Stack) -> None:
    with grpc.insecure_channel(stack.grpc_address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        # The shared stack serves broken models: strict readiness says not ready, as
        # /v2/health/ready does.
        ready = httpx.get(f"{stack.url}/v2/health/ready").status_code == 200
        expected = (
            health_pb2.HealthCheckResponse.SERVING
            if ready
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for service in ("", "inference.GRPCInferenceService"):
            answer = health.Check(health_pb2.HealthCheckRequest(service=service))
            assert answer.status == expected
        with pytest.raises(grpc.RpcError) as info:
            health.Check(health_pb2.HealthCheckRequest(service="no.such.Service"))
        assert info.value.code() == grpc.StatusCode.NOT_FOUND

        database = ProtoReflectionDescriptorDatabase(channel)
        services = set(database.get_services())
        assert {"inference.GRPCInferenceService", "grpc.health.v1.Health"} <= services
        found = database.FindFileContainingSymbol("inference.GRPCInferenceService")
        assert found.name == "grpc_service.proto"


def test_malformed_and_oversized_messages_are_refused(
    stack: Stack, client: grpcclient.InferenceServerClient
) -> None:
    with grpc.insecure_channel(stack.grpc_address) as channel:
        infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
        with pytest.raises(grpc.RpcError) as info:
            infer(b"\xff\xff\xff\xff not a protobuf message")
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "malformed ModelInferRequest" in info.value.details()
        index = channel.unary_unary("/inference.GRPCInferenceService/RepositoryIndex")
        with pytest.raises(grpc.RpcError) as info:
            index(b"\x0a\xff\xff")
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # Control calls take at most SLUICE_MAX_CONTROL_BODY_BYTES (1 MiB), as over REST; on
    # this stack the receive limit (its 1 MiB body limit) refuses them first, with the same
    # code (test_grpc_limits.py has a stack where the control limit is the smaller one).
    rejected(
        lambda: client.register_system_shared_memory("r", "k" * (2 << 20), 16),
        "RESOURCE_EXHAUSTED",
        str(1 << 20),
    )
    assert client.is_server_live()
