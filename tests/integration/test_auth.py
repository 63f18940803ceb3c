"""API keys (SLUICE_API_KEYS, SLUICE_API_KEYS_FILE, SLUICE_ADMIN_KEYS) over real HTTP.

Inference and metadata endpoints need an inference or admin key, management
endpoints an admin key, health endpoints none; refusals are 401 (with
``WWW-Authenticate: Bearer``) or 403 with a JSON error, and no key is ever logged.
"""

from __future__ import annotations

import queue
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from sluice.scheduler.executor.redis_server import RedisServer
from tests.support.onnx_models import write_identity
from tests.support.stack import Stack

INFERENCE_KEYS = ("infer-key-1", "infer-key-2")
FILE_KEYS = ("file-key-from-disk-1", "file-key-from-disk-2")
ADMIN_KEY = "admin-key"
WRONG_KEY = "wrong-key-0123456789"
MODEL = "guarded"
BODY = orjson.dumps(
    {"inputs": [{"name": "IN_FP32", "shape": [1, 3], "datatype": "FP32", "data": [1, 2, 3]}]}
)

INFERENCE_ENDPOINTS = [
    ("GET", "/v2"),
    ("GET", f"/v2/models/{MODEL}"),
    ("GET", f"/v2/models/{MODEL}/versions/1"),
    ("GET", f"/v2/models/{MODEL}/ready"),
    ("GET", f"/v2/models/{MODEL}/config"),
    ("GET", f"/v2/models/{MODEL}/stats"),
    ("GET", "/v2/models/stats"),
    ("POST", f"/v2/models/{MODEL}/infer"),
    ("POST", f"/v2/models/{MODEL}/versions/1/infer"),
]
MANAGEMENT_ENDPOINTS = [("POST", "/v2/repository/index")]
HEALTH_ENDPOINTS = [("GET", "/v2/health/live"), ("GET", "/v2/health/ready")]


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("auth")
    write_identity(root / "repository", MODEL, ["FP32"])
    key_file = root / "keys.txt"
    key_file.write_text(f"{FILE_KEYS[0]}\n\n  {FILE_KEYS[1]}  \n")
    stack = Stack(
        root / "repository",
        redis_server.url,
        env={
            "SLUICE_API_KEYS": ",".join(INFERENCE_KEYS),
            "SLUICE_API_KEYS_FILE": str(key_file),
            "SLUICE_ADMIN_KEYS": ADMIN_KEY,
        },
    )
    stack.start()
    yield stack
    stack.stop()


@pytest.fixture(scope="module")
def http(secured: Stack) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=secured.url, timeout=10) as client:
        yield client


def call(http: httpx.Client, method: str, path: str, key: str | None, scheme: str = "Bearer"):  # type: ignore[no-untyped-def]
    headers = {} if key is None else {"Authorization": f"{scheme} {key}".strip()}
    content = BODY if path.endswith("/infer") else b""
    return http.request(method, path, headers=headers, content=content)


def assert_refused(response: httpx.Response, status: int) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert isinstance(error, str) and error
    if status == 401:
        assert response.headers["www-authenticate"].startswith("Bearer")


@pytest.mark.parametrize(("method", "path"), INFERENCE_ENDPOINTS + MANAGEMENT_ENDPOINTS)
def test_missing_or_wrong_key_is_401(http: httpx.Client, method: str, path: str) -> None:
    assert_refused(call(http, method, path, None), 401)
    assert_refused(call(http, method, path, WRONG_KEY), 401)
    assert_refused(call(http, method, path, ""), 401)
    assert_refused(call(http, method, path, INFERENCE_KEYS[0], scheme="Basic"), 401)
    assert_refused(call(http, method, path, INFERENCE_KEYS[0] + "x"), 401)


@pytest.mark.parametrize(("method", "path"), INFERENCE_ENDPOINTS)
@pytest.mark.parametrize("key", [*INFERENCE_KEYS, *FILE_KEYS, ADMIN_KEY])
def test_inference_endpoints_accept_every_key(
    http: httpx.Client, method: str, path: str, key: str
) -> None:
    response = call(http, method, path, key)
    assert response.status_code == 200, response.text


def test_bearer_scheme_is_case_insensitive(http: httpx.Client) -> None:
    assert call(http, "GET", "/v2", INFERENCE_KEYS[1], scheme="bearer").status_code == 200


@pytest.mark.parametrize(("method", "path"), MANAGEMENT_ENDPOINTS)
def test_management_needs_the_admin_key(http: httpx.Client, method: str, path: str) -> None:
    for key in (*INFERENCE_KEYS, *FILE_KEYS):
        assert_refused(call(http, method, path, key), 403)
    response = call(http, method, path, ADMIN_KEY)
    assert response.status_code == 200, response.text
    assert any(row["name"] == MODEL for row in response.json())


@pytest.mark.parametrize(("method", "path"), HEALTH_ENDPOINTS)
def test_health_needs_no_key(http: httpx.Client, method: str, path: str) -> None:
    assert call(http, method, path, None).status_code == 200
    assert call(http, method, path, WRONG_KEY).status_code == 200


def test_tritonclient_with_an_authorization_header(secured: Stack) -> None:
    data = np.array([[1.5, -2.0, 3.25]], dtype=np.float32)
    with httpclient.InferenceServerClient(secured.address) as client:
        tensor = httpclient.InferInput("IN_FP32", list(data.shape), "FP32")
        tensor.set_data_from_numpy(data, binary_data=True)
        for key in (INFERENCE_KEYS[0], FILE_KEYS[0]):
            headers = {"Authorization": f"Bearer {key}"}
            assert client.is_server_ready(headers=headers)
            assert client.is_model_ready(MODEL, headers=headers)
            assert client.get_model_metadata(MODEL, headers=headers)["name"] == MODEL
            result = client.infer(MODEL, [tensor], headers=headers)
            np.testing.assert_array_equal(result.as_numpy("OUT_FP32"), data)
        with pytest.raises(InferenceServerException) as refused:
            client.infer(MODEL, [tensor])
        assert refused.value.status() == "401"
        with pytest.raises(InferenceServerException) as wrong:
            client.get_model_metadata(MODEL, headers={"Authorization": f"Bearer {WRONG_KEY}"})
        assert wrong.value.status() == "401"


def test_grpc_calls_take_the_same_keys(secured: Stack) -> None:
    """Metadata ``authorization: Bearer <key>``: inference calls take any key, management
    calls the admin key; health checking needs none."""
    import grpc
    import tritonclient.grpc as grpcclient
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    data = np.array([[1.5, -2.0, 3.25]], dtype=np.float32)
    with grpcclient.InferenceServerClient(secured.grpc_address) as client:
        tensor = grpcclient.InferInput("IN_FP32", list(data.shape), "FP32")
        tensor.set_data_from_numpy(data)
        for key in (INFERENCE_KEYS[1], FILE_KEYS[1], ADMIN_KEY):
            headers = {"authorization": f"Bearer {key}"}
            assert client.is_model_ready(MODEL, headers=headers)
            result = client.infer(MODEL, [tensor], headers=headers)
            np.testing.assert_array_equal(result.as_numpy("OUT_FP32"), data)
        for headers, status in (
            ({}, "StatusCode.UNAUTHENTICATED"),
            ({"authorization": f"Bearer {WRONG_KEY}"}, "StatusCode.UNAUTHENTICATED"),
        ):
            with pytest.raises(InferenceServerException) as refused:
                client.infer(MODEL, [tensor], headers=headers)
            assert refused.value.status() == status
            assert "API key" in refused.value.message()
        inference = {"authorization": f"Bearer {INFERENCE_KEYS[0]}"}
        with pytest.raises(InferenceServerException) as forbidden:
            client.get_model_repository_index(headers=inference)
        assert forbidden.value.status() == "StatusCode.PERMISSION_DENIED"
        admin = {"authorization": f"Bearer {ADMIN_KEY}"}
        assert client.get_model_repository_index(headers=admin).models[0].name == MODEL
        assert client.get_system_shared_memory_status(headers=admin).regions == {}

        errors: queue.Queue[InferenceServerException] = queue.Queue()
        client.start_stream(callback=lambda result, error: errors.put(error))
        # No key: the stream is refused as it opens, before any request.
        assert errors.get(timeout=10).status() == "StatusCode.UNAUTHENTICATED"
        client.stop_stream()
    with grpc.insecure_channel(secured.grpc_address) as channel:
        check = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert check.status == health_pb2.HealthCheckResponse.SERVING


OPEN_PATHS = ("/v2/health/", "/ping")
_PARAMETERS = {"model": "no-such-model", "version": "1", "label": "production"}


def openapi_routes(http: httpx.Client) -> list[tuple[str, str, bool]]:
    """Every (method, concrete path, management?) of the gateway's OpenAPI schema, path
    parameters filled with names that exist nowhere, so no call changes anything."""
    from sluice.gateway.tenants.keys import is_management

    schema = call(http, "GET", "/openapi.json", ADMIN_KEY).json()
    routes = []
    for template, operations in schema["paths"].items():
        path = template
        for name in re.findall(r"{(\w+)}", template):
            path = path.replace(f"{{{name}}}", _PARAMETERS.get(name, "x0"))
        for method in operations:
            routes.append((method.upper(), path, is_management(path)))
    return routes


def test_every_route_of_the_schema_is_guarded(http: httpx.Client) -> None:
    """Walks every route the gateway declares, with no key, a wrong key, an inference key and
    an admin key: only health is open, management is the admin key's alone."""
    routes = openapi_routes(http)
    assert len(routes) > 50, routes
    management = [r for r in routes if r[2]]
    assert {"/v2/repository/index", "/v2/logging", "/models"} <= {p for _, p, _ in management}
    for method, path, is_admin_only in routes:
        where = f"{method} {path}"
        if path.startswith(OPEN_PATHS):
            assert call(http, method, path, None).status_code not in (401, 403), where
            continue
        assert_refused(call(http, method, path, None), 401)
        assert_refused(call(http, method, path, WRONG_KEY), 401)
        as_user = call(http, method, path, INFERENCE_KEYS[0])
        if is_admin_only:
            assert as_user.status_code == 403, (where, as_user.text)
        else:
            assert as_user.status_code not in (401, 403), (where, as_user.text)
        as_admin = call(http, method, path, ADMIN_KEY)
        assert as_admin.status_code not in (401, 403), (where, as_admin.text)


def grpc_code(channel: Any, method: Any, key: str | None) -> Any:
    """The status code of one call of ``method`` (an empty request) with ``key``."""
    import grpc
    from tritonclient.grpc import service_pb2

    request_type = getattr(service_pb2, method.input_type.name)
    path = f"/{method.containing_service.full_name}/{method.name}"
    metadata = () if key is None else (("authorization", f"Bearer {key}"),)
    try:
        if method.name == "ModelStreamInfer":
            stream = channel.stream_stream(path, request_serializer=request_type.SerializeToString)
            for _ in stream(iter([request_type()]), metadata=metadata, timeout=10):
                break
        else:
            unary = channel.unary_unary(path, request_serializer=request_type.SerializeToString)
            unary(request_type(), metadata=metadata, timeout=10)
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def test_every_grpc_method_is_guarded(secured: Stack) -> None:
    """Every method of Triton's gRPC service: no key or a wrong key is UNAUTHENTICATED, an
    inference key on a management method PERMISSION_DENIED, an admin key gets through."""
    import grpc
    from tritonclient.grpc import service_pb2

    from sluice.gateway.grpc_api.server import _MANAGEMENT

    service = service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    assert len(service.methods) > 15
    denied = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)
    with grpc.insecure_channel(secured.grpc_address) as channel:
        for method in service.methods:
            name = method.name
            if name in ("ServerLive", "ServerReady"):
                assert grpc_code(channel, method, None) not in denied, name
                continue
            assert grpc_code(channel, method, None) == grpc.StatusCode.UNAUTHENTICATED, name
            assert grpc_code(channel, method, WRONG_KEY) == grpc.StatusCode.UNAUTHENTICATED, name
            as_user = grpc_code(channel, method, INFERENCE_KEYS[0])
            if name in _MANAGEMENT:
                assert as_user == grpc.StatusCode.PERMISSION_DENIED, name
            else:
                assert as_user not in denied, name
            assert grpc_code(channel, method, ADMIN_KEY) not in denied, name


def test_keys_never_appear_in_the_logs(secured: Stack, http: httpx.Client) -> None:
    for key in (*INFERENCE_KEYS, *FILE_KEYS, ADMIN_KEY, WRONG_KEY):
        call(http, "POST", "/v2/repository/index", key)
        call(http, "POST", f"/v2/models/{MODEL}/infer", key)
    secured.stop()
    log = "".join(secured.stderr_lines)
    assert log, "the stack logged nothing at all"
    for secret in (*INFERENCE_KEYS, *FILE_KEYS, ADMIN_KEY, WRONG_KEY):
        assert secret not in log, f"key {secret!r} appears in the log"


def test_unreadable_key_file_is_a_clear_startup_error(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    write_identity(tmp_path, MODEL, ["FP32"])
    stack = Stack(
        tmp_path, redis_server.url, env={"SLUICE_API_KEYS_FILE": str(tmp_path / "missing.txt")}
    )
    with pytest.raises(RuntimeError) as failed:
        stack.start(timeout_s=60)
    assert "SLUICE_API_KEYS_FILE" in str(failed.value)


def test_tenant_keys_alone_start_and_management_is_nobodys(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """``tenant:key`` inference keys and no admin key: ``sluice up`` still becomes ready (its
    readiness probe has a key of its own), every key works for inference, and management
    routes are refused to all of them."""
    write_identity(tmp_path, MODEL, ["FP32"])
    stack = Stack(tmp_path, redis_server.url, env={"SLUICE_API_KEYS": "team-a:k-a,team-b:k-b"})
    stack.start(timeout_s=90)
    try:
        with httpx.Client(base_url=stack.url, timeout=10) as http:
            for key in ("k-a", "k-b"):
                assert call(http, "POST", f"/v2/models/{MODEL}/infer", key).status_code == 200
                refused = call(http, "POST", "/v2/repository/index", key)
                assert_refused(refused, 403)
                assert "none is set (SLUICE_ADMIN_KEYS)" not in refused.json()["error"]
            assert_refused(call(http, "POST", "/v2/repository/index", None), 401)
    finally:
        stack.stop()
