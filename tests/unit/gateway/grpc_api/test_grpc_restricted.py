"""Triton's --grpc-restricted-protocol on an in-process gRPC server: the ``health``
category covers the health checking protocol (``grpc.health.v1.Health``) as it covers
ServerLive, ServerReady and ModelReady, as in Triton; ModelInfer is refused before its
message is read, and metadata given twice passes only when both copies agree."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tritonclient.grpc import service_pb2

from sluice.core.settings import GatewaySettings
from sluice.gateway.grpc_api.server import GrpcServer
from sluice.gateway.state import GatewayState
from sluice.scheduler.executor.redis_server import free_port
from tests.unit.gateway.in_process import EchoDispatcher, in_process_gateway

IDENTITY = """
name: "ident"
backend: "onnxruntime"
max_batch_size: 8
input [{ name: "IN" data_type: TYPE_FP32 dims: [-1] }]
output [{ name: "OUT" data_type: TYPE_FP32 dims: [-1] }]
"""
ALLOWED = (("triton-grpc-protocol-health-key", "health-value"),)
INFER_KEY = "triton-grpc-protocol-infer-key"


@pytest.fixture
async def channel() -> AsyncIterator[grpc.aio.Channel]:
    settings = GatewaySettings(
        grpc_port=free_port(),
        grpc_restricted_protocol="health:health-key=health-value;inference:infer-key=v",
    )
    app = in_process_gateway("ident", IDENTITY, EchoDispatcher(["OUT"]), settings)
    state: GatewayState = app.app.state.sluice
    server = GrpcServer(state)
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{settings.grpc_port}") as opened:
            yield opened
    finally:
        await server.stop(0)


async def test_the_health_category_restricts_the_health_checking_protocol(
    channel: grpc.aio.Channel,
) -> None:
    stub = health_pb2_grpc.HealthStub(channel)
    request = health_pb2.HealthCheckRequest(service="")
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await stub.Check(request)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert refused.value.details() == (
        "This protocol is restricted, expecting header 'triton-grpc-protocol-health-key'"
    )
    with pytest.raises(grpc.aio.AioRpcError) as watched:
        async for _ in stub.Watch(request):
            pass
    assert watched.value.code() == grpc.StatusCode.UNAVAILABLE
    wrong = (("triton-grpc-protocol-health-key", "health-valu"),)  # a prefix of the value
    with pytest.raises(grpc.aio.AioRpcError, match="restricted"):
        await stub.Check(request, metadata=wrong)
    answer = await stub.Check(request, metadata=ALLOWED)
    assert answer.status == health_pb2.HealthCheckResponse.SERVING
    first = await anext(aiter(stub.Watch(request, metadata=ALLOWED)))
    assert first.status == health_pb2.HealthCheckResponse.SERVING


async def test_model_infer_and_repeated_metadata(channel: grpc.aio.Channel) -> None:
    infer = channel.unary_unary(
        "/inference.GRPCInferenceService/ModelInfer",
        request_serializer=service_pb2.ModelInferRequest.SerializeToString,
        response_deserializer=service_pb2.ModelInferResponse.FromString,
    )
    request = service_pb2.ModelInferRequest(model_name="ident")
    tensor = request.inputs.add(name="IN", datatype="FP32", shape=[1, 1])
    tensor.contents.fp32_contents.append(2.0)
    for metadata in ((), ((INFER_KEY, "w"),), ((INFER_KEY, "v"), (INFER_KEY, "w"))):
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await infer(request, metadata=metadata)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert refused.value.details() == (
            f"This protocol is restricted, expecting header '{INFER_KEY}'"
        )
    answer = await infer(request, metadata=((INFER_KEY, "v"), (INFER_KEY, "v")))
    assert answer.model_name == "ident"
    ready = channel.unary_unary(
        "/inference.GRPCInferenceService/ServerReady",
        request_serializer=service_pb2.ServerReadyRequest.SerializeToString,
        response_deserializer=service_pb2.ServerReadyResponse.FromString,
    )
    twice = (*ALLOWED, ("triton-grpc-protocol-health-key", "other"))
    with pytest.raises(grpc.aio.AioRpcError, match="restricted"):
        await ready(service_pb2.ServerReadyRequest(), metadata=twice)
    assert (await ready(service_pb2.ServerReadyRequest(), metadata=ALLOWED)).ready
