"""What the gateway answers about a model whose load failed (UNAVAILABLE in the repository
index), over REST and gRPC: Triton's statuses and texts (core ``ModelLifeCycle::GetModel``),
not those of a model unloaded. Asked without a version: NOT_FOUND "has no available
versions"; for a version it tried: UNAVAILABLE "not at ready state"; for another: NOT_FOUND
"is not found". Readiness: not ready. Sluice's reason follows Triton's text after ``; ``."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace

import grpc
import httpx
import pytest
from tritonclient.grpc import service_pb2, service_pb2_grpc

from sluice.core.catalog import UNLOADED, CatalogEntry
from sluice.core.keys import load_error_field
from sluice.core.settings import GatewaySettings
from sluice.gateway.grpc_api.server import GrpcServer
from sluice.gateway.http.fast_path import InferFastPath
from sluice.scheduler.executor.redis_server import free_port
from tests.support.onnx_models import identity_config
from tests.unit.gateway.in_process import EchoDispatcher, in_process_gateway

BODY = {"inputs": [{"name": "IN_FP32", "shape": [1, 1], "datatype": "FP32", "data": [1]}]}
UNKNOWN = "Request for unknown model: 'broken'"


@pytest.fixture
def gateway() -> InferFastPath:
    """``broken``: versions 1 and 2 served, both failed to load (a worker could not read
    the file); ``bad_config``: a model whose configuration cannot be read."""
    settings = GatewaySettings(grpc_port=free_port())
    app = in_process_gateway(
        "broken",
        identity_config("broken", ["FP32"], [-1], 8),
        EchoDispatcher(["OUT_FP32"]),
        settings,
    )
    view = app.app.state.sluice.view
    view.models["broken"] = replace(view.models["broken"], versions=(1, 2))
    view.ready = {}
    view.load_errors = {
        load_error_field("broken", 1): "not an onnx file",
        load_error_field("broken", 2): "not an onnx file",
    }
    view.models["bad_config"] = CatalogEntry("bad_config", (), None, "max_batch_size: eight")
    return app


@pytest.fixture
def client(gateway: InferFastPath) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=gateway), base_url="http://gateway")


async def _error(answer: httpx.Response) -> tuple[int, str]:
    return answer.status_code, answer.json()["error"]


async def test_asked_without_a_version_it_has_no_available_versions(
    client: httpx.AsyncClient,
) -> None:
    async with client:
        answers = [
            await client.post("/v2/models/broken/infer", json=BODY),
            await client.get("/v2/models/broken"),
            await client.get("/v2/models/broken/config"),
        ]
        ready = await client.get("/v2/models/broken/ready")
    for answer in answers:
        status, message = await _error(answer)
        assert status == 404, answer.url
        assert message == (
            f"{UNKNOWN} has no available versions; version 2 is unavailable: not an onnx file"
        )
    assert ready.status_code == 400
    assert ready.json()["error"].startswith(
        f"Model version not ready; {UNKNOWN} has no available versions"
    )


async def test_a_version_it_tried_is_not_at_ready_state_another_is_not_found(
    client: httpx.AsyncClient,
) -> None:
    async with client:
        tried = [
            await client.post("/v2/models/broken/versions/1/infer", json=BODY),
            await client.get("/v2/models/broken/versions/1"),
            await client.get("/v2/models/broken/versions/1/config"),
        ]
        other = [
            await client.post("/v2/models/broken/versions/3/infer", json=BODY),
            await client.get("/v2/models/broken/versions/3"),
        ]
        ready = await client.get("/v2/models/broken/versions/1/ready")
    for answer in tried:
        status, message = await _error(answer)
        assert status == 503, answer.url
        assert message.startswith(f"{UNKNOWN} version 1 is not at ready state; "), message
    for answer in other:
        assert await _error(answer) == (404, f"{UNKNOWN} version 3 is not found"), answer.url
    assert ready.status_code == 400
    assert ready.json()["error"].startswith(
        f"Model version not ready; {UNKNOWN} version 1 is not at ready state"
    )


async def test_a_model_whose_configuration_failed_is_answered_alike(
    client: httpx.AsyncClient,
) -> None:
    unknown = "Request for unknown model: 'bad_config'"
    async with client:
        bare = await client.post("/v2/models/bad_config/infer", json=BODY)
        metadata = await client.get("/v2/models/bad_config")
        versioned = await client.get("/v2/models/bad_config/versions/1/config")
    for answer in (bare, metadata):
        assert await _error(answer) == (
            404,
            f"{unknown} has no available versions; model 'bad_config' is unavailable: "
            "max_batch_size: eight",
        ), answer.url
    assert await _error(versioned) == (404, f"{unknown} version 1 is not found")


async def test_a_model_with_one_version_loaded_lists_only_that_one(
    gateway: InferFastPath, client: httpx.AsyncClient
) -> None:
    """Triton's metadata lists the versions that are ready, not the failed one."""
    view = gateway.app.state.sluice.view
    view.load_errors.pop(load_error_field("broken", 2))
    view.ready = {"broken": frozenset((2,))}
    async with client:
        metadata = await client.get("/v2/models/broken")
        answer = await client.post("/v2/models/broken/infer", json=BODY)
    assert metadata.status_code == 200
    assert metadata.json()["versions"] == ["2"]
    assert answer.status_code == 200, answer.text


async def test_with_namespacing_it_is_named_by_its_repository(
    gateway: InferFastPath, client: httpx.AsyncClient
) -> None:
    view = gateway.app.state.sluice.view
    view.namespacing = True
    view.models["broken"] = replace(view.models["broken"], namespace="/models/a")
    async with client:
        bare = await client.post("/v2/models/broken/infer", json=BODY)
        tried = await client.get("/v2/models/broken/versions/1/config")
    status, message = await _error(bare)
    assert status == 404
    assert message.startswith("Request for unknown model: '/models/a::broken' has no available")
    status, message = await _error(tried)
    assert status == 503
    assert message.startswith("Request for unknown model: '/models/a::broken' version 1 is not at")


async def test_a_model_unloaded_is_still_unavailable(
    gateway: InferFastPath, client: httpx.AsyncClient
) -> None:
    """Explicit model control, without namespacing: as before, 503."""
    view = gateway.app.state.sluice.view
    view.models["idle"] = CatalogEntry("idle", (), None, UNLOADED)
    async with client:
        answer = await client.post("/v2/models/idle/infer", json=BODY)
        metadata = await client.get("/v2/models/idle")
    for sent in (answer, metadata):
        status, message = await _error(sent)
        assert status == 503, sent.url
        assert message.startswith("Request for unknown model: 'idle' has no available versions")


async def test_an_on_demand_model_refused_is_unavailable(
    gateway: InferFastPath, client: httpx.AsyncClient
) -> None:
    """Sluice's own on-demand loading: a version the budget refused is 503 with the reason,
    as the requests that waited for it were answered."""
    view = gateway.app.state.sluice.view
    view.models["broken"] = replace(view.models["broken"], on_demand=True)
    async with client:
        answer = await client.post("/v2/models/broken/infer", json=BODY)
    status, message = await _error(answer)
    assert status == 503
    assert message.endswith("version 2 is unavailable: not an onnx file")


@pytest.fixture
async def stub(gateway: InferFastPath) -> AsyncIterator[service_pb2_grpc.GRPCInferenceServiceStub]:
    state = gateway.app.state.sluice
    server = GrpcServer(state)
    await server.start()
    try:
        address = f"127.0.0.1:{state.settings.grpc_port}"
        async with grpc.aio.insecure_channel(address) as channel:
            yield service_pb2_grpc.GRPCInferenceServiceStub(channel)
    finally:
        await server.stop(0)


async def test_grpc_answers_with_the_same_codes(
    stub: service_pb2_grpc.GRPCInferenceServiceStub,
) -> None:
    calls = [
        (stub.ModelMetadata(service_pb2.ModelMetadataRequest(name="broken")), "NOT_FOUND"),
        (stub.ModelConfig(service_pb2.ModelConfigRequest(name="broken")), "NOT_FOUND"),
        (
            stub.ModelConfig(service_pb2.ModelConfigRequest(name="broken", version="1")),
            "UNAVAILABLE",
        ),
        (
            stub.ModelMetadata(service_pb2.ModelMetadataRequest(name="broken", version="3")),
            "NOT_FOUND",
        ),
    ]
    for call, code in calls:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await call
        assert refused.value.code() == getattr(grpc.StatusCode, code)
        assert (refused.value.details() or "").startswith(UNKNOWN)
    infer = service_pb2.ModelInferRequest(model_name="broken")
    tensor = infer.inputs.add(name="IN_FP32", datatype="FP32", shape=[1, 1])
    tensor.contents.fp32_contents.append(1.0)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await stub.ModelInfer(infer)
    assert refused.value.code() == grpc.StatusCode.NOT_FOUND
    assert (refused.value.details() or "").startswith(f"{UNKNOWN} has no available versions")
    ready = await stub.ModelReady(service_pb2.ModelReadyRequest(name="broken"))
    assert not ready.ready
