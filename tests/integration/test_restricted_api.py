"""Triton's --http-restricted-api and --grpc-restricted-protocol on a real stack, through
tritonclient as Triton's own tests use them: the restricted categories answer only with
the agreed header (HTTP 403, gRPC UNAVAILABLE, Triton's texts), the others as before."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from sluice.scheduler.executor.redis_server import RedisServer
from tests.support.onnx_models import write_identity
from tests.support.stack import Stack

ADMIN = {"admin-key": "admin-value"}
GRPC_ADMIN = {"triton-grpc-protocol-admin-key": "admin-value"}
INFER = {"infer-key": "infer-value"}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("restricted")
    write_identity(root, "ident", ["FP32"])
    args = [
        "--model-control-mode=explicit",
        "--load-model=ident",
        "--http-restricted-api=model-repository,statistics:admin-key=admin-value",
        "--http-restricted-api=inference:infer-key=infer-value",
        "--grpc-restricted-protocol=model-repository,statistics:admin-key=admin-value",
    ]
    started = Stack(root, redis_server.url, args=args)
    started.start()
    yield started
    started.stop()


def _input(module: type) -> list:  # type: ignore[type-arg]
    tensor = module.InferInput("IN_FP32", [1, 2], "FP32")  # type: ignore[attr-defined]
    tensor.set_data_from_numpy(np.ones((1, 2), dtype=np.float32))
    return [tensor]


def test_http_restricted_categories_need_their_header(stack: Stack) -> None:
    client = httpclient.InferenceServerClient(stack.address)
    try:
        with pytest.raises(InferenceServerException) as refused:
            client.get_model_repository_index()
        assert "This API is restricted, expecting header 'admin-key'" in str(refused.value)
        assert client.get_model_repository_index(headers=ADMIN)
        with pytest.raises(InferenceServerException, match="expecting header 'admin-key'"):
            client.get_inference_statistics("ident")
        assert client.get_inference_statistics("ident", headers=ADMIN)["model_stats"]
        with pytest.raises(InferenceServerException, match="expecting header 'infer-key'"):
            client.infer("ident", _input(httpclient), headers=dict(ADMIN))
        answer = client.infer("ident", _input(httpclient), headers=dict(INFER))
        assert answer.as_numpy("OUT_FP32").tolist() == [[1.0, 1.0]]
        # Unrestricted categories answer as before.
        assert client.is_server_live() and client.is_model_ready("ident")
        assert client.get_model_config("ident")["name"] == "ident"
    finally:
        client.close()
    plain = httpx.post(f"{stack.url}/v2/repository/index", headers={"admin-key": "wrong"})
    assert plain.status_code == 403
    assert plain.json() == {"error": "This API is restricted, expecting header 'admin-key'"}


def test_grpc_restricted_protocols_need_their_prefixed_metadata(stack: Stack) -> None:
    client = grpcclient.InferenceServerClient(stack.grpc_address)
    try:
        with pytest.raises(InferenceServerException) as refused:
            client.unload_model("ident")
        assert refused.value.status() == "StatusCode.UNAVAILABLE"
        assert (
            "This protocol is restricted, expecting header 'triton-grpc-protocol-admin-key'"
            in str(refused.value)
        )
        with pytest.raises(InferenceServerException, match="restricted"):
            client.get_inference_statistics("ident", headers=ADMIN)  # (not prefixed)
        assert client.get_inference_statistics("ident", headers=GRPC_ADMIN).model_stats
        # Inference is not restricted over gRPC here (only over HTTP).
        answer = client.infer("ident", _input(grpcclient))
        assert answer.as_numpy("OUT_FP32").tolist() == [[1.0, 1.0]]
        assert client.is_server_ready()
    finally:
        client.close()
