"""Inference responses compressed as the client accepts, as Triton's HTTP server does:
tritonclient's ``response_compression_algorithm`` (gzip, deflate) and a plain client's
``Accept-Encoding``, JSON and binary answers alike."""

from __future__ import annotations

import gzip
import socket
from collections.abc import Iterator

import numpy as np
import orjson
import pytest
import tritonclient.http as httpclient

from sluice.scheduler.executor.redis_server import RedisServer
from tests.support.onnx_models import write_identity
from tests.support.stack import Stack


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("compression")
    write_identity(root, "echo", ["FP32"])
    started = Stack(root, redis_server.url, grpc_port=0)
    started.start()
    yield started
    started.stop()


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
@pytest.mark.parametrize("binary", [False, True])
def test_tritonclient_reads_compressed_answers(stack: Stack, algorithm: str, binary: bool) -> None:
    data = np.arange(2_000, dtype=np.float32).reshape(1, 2_000)
    tensor = httpclient.InferInput("IN_FP32", [1, 2_000], "FP32")
    tensor.set_data_from_numpy(data, binary_data=binary)
    output = httpclient.InferRequestedOutput("OUT_FP32", binary_data=binary)
    with httpclient.InferenceServerClient(stack.address) as client:
        result = client.infer(
            "echo", [tensor], outputs=[output], response_compression_algorithm=algorithm
        )
    np.testing.assert_array_equal(result.as_numpy("OUT_FP32"), data)


def _post(stack: Stack, body: bytes, accept: str) -> tuple[bytes, bytes]:
    """(head, body) of a raw request (no client decompresses anything on the way)."""
    with socket.create_connection(("127.0.0.1", stack.port), timeout=30) as conn:
        conn.sendall(
            b"POST /v2/models/echo/infer HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
            b"Content-Type: application/json\r\n"
            + f"Accept-Encoding: {accept}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        raw = b""
        while chunk := conn.recv(65536):
            raw += chunk
    head, _, payload = raw.partition(b"\r\n\r\n")
    return head.lower(), payload


def test_a_plain_client_gets_gzip_when_it_asks_and_small_answers_as_they_are(
    stack: Stack,
) -> None:
    values = list(range(1_000))
    body = orjson.dumps(
        {"inputs": [{"name": "IN_FP32", "shape": [1, 1000], "datatype": "FP32", "data": values}]}
    )
    head, payload = _post(stack, body, "gzip, deflate")
    assert b"content-encoding: gzip" in head, head
    assert orjson.loads(gzip.decompress(payload))["outputs"][0]["data"] == values
    small = orjson.dumps(
        {"inputs": [{"name": "IN_FP32", "shape": [1, 2], "datatype": "FP32", "data": [1, 2]}]}
    )
    head, payload = _post(stack, small, "gzip")
    assert b"content-encoding" not in head
    assert orjson.loads(payload)["outputs"][0]["data"] == [1.0, 2.0]
    head, payload = _post(stack, body, "br")
    assert b"content-encoding" not in head and orjson.loads(payload)["outputs"]
