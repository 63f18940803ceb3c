"""Triton's answers where its clients and its own HTTP tests match on them, against one real
stack: sizes past 64 bits, JSON nested too deep, the repository index's ``ready``, shared
memory registrations and references, BYTES outputs that are not UTF-8 asked for as JSON,
bodies sent chunked with a Content-Length (compressed or raw), and the header tritonclient
refuses itself. Where Sluice answers otherwise on purpose (a negative dimension), the test
says so; docs/differences.md lists those."""

from __future__ import annotations

import gzip
import socket
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import numpy as np
import orjson
import pytest
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException

from sluice.scheduler.executor.redis_server import RedisServer
from tests.support.model_files import python_config, tensor, write_model
from tests.support.onnx_models import write_identity
from tests.support.stack import Stack

ECHO = """
class Model:
    def execute(self, inputs):
        return {"OUT": inputs["IN"]}
"""

BIG = 2**60 + 2


@pytest.fixture(scope="module")
def texts(tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("texts")
    write_identity(root, "fp32", ["FP32"], dims=(-1,))
    write_identity(root, "int64", ["INT64"], dims=(-1,))
    config = python_config(
        [tensor("IN", "TYPE_STRING", "-1")], [tensor("OUT", "TYPE_STRING", "-1")]
    )
    write_model(root, "echo", config, {"1/model.py": ECHO})
    stack = Stack(root, redis_server.url)
    stack.start()
    yield stack
    stack.stop()


@pytest.fixture
def http(texts: Stack) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=texts.url, timeout=30) as client:
        yield client


@pytest.fixture
def client(texts: Stack) -> Iterator[httpclient.InferenceServerClient]:
    with httpclient.InferenceServerClient(texts.address) as triton:
        yield triton
        triton.unregister_system_shared_memory()


def error(response: httpx.Response, status: int) -> str:
    assert response.status_code == status, response.text
    message = response.json()["error"]
    assert isinstance(message, str)
    return message


def one_input(name: str, datatype: str, shape: list[int], data: Any) -> dict[str, Any]:
    return {"inputs": [{"name": name, "shape": shape, "datatype": datatype, "data": data}]}


def test_sizes_past_64_bits_are_400_with_tritons_texts(http: httpx.Client) -> None:
    body = one_input("IN_FP32", "FP32", [16, BIG], [1.0])
    message = error(http.post("/v2/models/fp32/infer", json=body), 400)
    assert "causes total element count to exceed maximum size of" in message
    body = one_input("IN_FP32", "FP32", [4, BIG], [1.0])
    message = error(http.post("/v2/models/fp32/infer", json=body), 400)
    assert "byte size overflow for input" in message


def test_a_negative_dimension_is_a_400_not_tritons_500(http: httpx.Client) -> None:
    body = one_input("IN_FP32", "FP32", [2, -5], [1.0])
    message = error(http.post("/v2/models/fp32/infer", json=body), 400)
    assert message == "input 'IN_FP32': 'shape' dim 1 must be a non-negative integer, got -5"


@pytest.mark.parametrize(
    ("model", "name", "datatype", "value"),
    [("echo", "IN", "BYTES", "hello"), ("int64", "IN_INT64", "INT64", 123)],
)
def test_json_data_50_deep_is_served_and_120_deep_is_refused(
    http: httpx.Client, model: str, name: str, datatype: str, value: Any
) -> None:
    def nested(depth: int) -> Any:
        data = value
        for _ in range(depth):
            data = [data]
        return data

    body = one_input(name, datatype, [1, 1], nested(50))
    response = http.post(f"/v2/models/{model}/infer", json=body)
    assert response.status_code == 200, response.text
    body = one_input(name, datatype, [1, 1], nested(120))
    message = error(http.post(f"/v2/models/{model}/infer", json=body), 400)
    assert "JSON nesting depth exceeds maximum allowed limit (100)" in message


def test_repository_index_ready_that_is_no_boolean(http: httpx.Client) -> None:
    message = error(http.post("/v2/repository/index", json={"ready": "yes"}), 400)
    assert message.startswith("Invalid value for 'ready': expected a boolean")


# ---------------------------------------------------------------------------- shared memory


def refused(call: Callable[[], Any], status: str, text: str) -> None:
    with pytest.raises(InferenceServerException) as info:
        call()
    assert info.value.status() == status, info.value.message()
    assert text in str(info.value.message()), info.value.message()


@pytest.fixture
def region() -> Iterator[Any]:
    """A client's POSIX shm object of 64 bytes (tritonclient's own utilities)."""
    handle = shm.create_shared_memory_region("texts", f"/texts-{uuid.uuid4().hex}", 64)
    yield handle
    shm.destroy_shared_memory_region(handle)


def test_shared_memory_registrations_and_references(
    client: httpclient.InferenceServerClient, region: Any
) -> None:
    key = str(region._shm_key)
    refused(
        lambda: client.register_system_shared_memory("far", key, 8, offset=64),
        "400",
        "failed to register shared memory region 'far': invalid args",
    )
    refused(
        lambda: client.register_system_shared_memory("bad", "/a/b", 8),
        "400",
        "cannot register shared memory region 'bad' - invalid shm key '/a/b'",
    )
    client.register_system_shared_memory("r", key, 64)

    def infer_at(offset: int) -> Any:
        tensor = httpclient.InferInput("IN_FP32", [1, 4], "FP32")
        tensor.set_shared_memory("r", 16, offset)
        return client.infer("fp32", [tensor])

    assert infer_at(48).as_numpy("OUT_FP32").shape == (1, 4)
    refused(lambda: infer_at(64), "400", "Invalid offset for shared memory region: 'r'")
    refused(lambda: infer_at(56), "400", "Invalid offset + byte size for shared memory region: 'r'")


# ---------------------------------------------------------------------- BYTES, not UTF-8


def test_bytes_that_are_not_utf8_asked_for_as_json(
    client: httpclient.InferenceServerClient,
) -> None:
    words = np.array([[b"\xff\xfe", b"ok"]], dtype=np.object_)
    tensor = httpclient.InferInput("IN", [1, 2], "BYTES")
    tensor.set_data_from_numpy(words)
    as_json = httpclient.InferRequestedOutput("OUT", binary_data=False)
    refused(
        lambda: client.infer("echo", [tensor], outputs=[as_json]),
        "400",
        "Failed to encode using UTF-8. Please use binary_data=True, if you want to pass a byte "
        "array.",
    )
    as_binary = httpclient.InferRequestedOutput("OUT", binary_data=True)
    result = client.infer("echo", [tensor], outputs=[as_binary])
    assert result.as_numpy("OUT").tolist() == words.tolist()


# ------------------------------------------------------------------- how bodies arrive


def exchange(texts: Stack, head: list[str], body: bytes) -> tuple[bytes, bytes]:
    """A request written as it is on a socket; the answer's head and body (the server
    closes the connection after it)."""
    request = "\r\n".join([*head, f"Host: {texts.address}", "", ""]).encode() + body
    with socket.create_connection(("127.0.0.1", texts.port), timeout=30) as connection:
        connection.sendall(request)
        answer = b""
        while chunk := connection.recv(65536):
            answer += chunk
    answer_head, _, answer_body = answer.partition(b"\r\n\r\n")
    return answer_head, answer_body


def chunked(body: bytes) -> bytes:
    return b"%X\r\n%s\r\n0\r\n\r\n" % (len(body), body)


def test_a_raw_body_chunked_by_hand_with_a_content_length(texts: Stack) -> None:
    """What ``requests`` sends for ``data=`` with the caller's own Transfer-Encoding."""
    values = np.arange(8, dtype=np.float32).tobytes()
    wire = chunked(values)
    head, body = exchange(
        texts,
        [
            "POST /v2/models/fp32/infer HTTP/1.1",
            "Inference-Header-Content-Length: 0",
            "Transfer-Encoding: chunked",
            f"Content-Length: {len(wire)}",
        ],
        wire,
    )
    assert head.startswith(b"HTTP/1.1 200 OK"), head
    lines = dict(line.split(b": ", 1) for line in head.lower().split(b"\r\n")[1:])
    assert lines[b"connection"] == b"close"
    assert body[int(lines[b"inference-header-content-length"]) :] == values


def test_a_gzip_body_sent_chunked_with_a_content_length(texts: Stack) -> None:
    request = orjson.dumps(one_input("IN_FP32", "FP32", [1, 2], [1.5, 2.5]))
    wire = chunked(gzip.compress(request))
    head, body = exchange(
        texts,
        [
            "POST /v2/models/fp32/infer HTTP/1.1",
            "Content-Type: application/json",
            "Content-Encoding: gzip",
            "Transfer-Encoding: chunked",
            f"Content-Length: {len(wire)}",
        ],
        wire,
    )
    assert head.startswith(b"HTTP/1.1 200 OK"), head
    assert orjson.loads(body)["outputs"][0]["data"] == [1.5, 2.5]


@pytest.mark.parametrize("encoding", ["chunked", "compress", "deflate", "gzip"])
def test_tritonclient_refuses_a_transfer_encoding_header_itself(
    client: httpclient.InferenceServerClient, encoding: str
) -> None:
    tensor = httpclient.InferInput("IN_FP32", [1, 8], "FP32")
    tensor.set_data_from_numpy(np.arange(8, dtype=np.float32).reshape(1, -1))
    with pytest.raises(InferenceServerException, match="Unsupported HTTP header"):
        client.infer("fp32", [tensor], headers={"Transfer-Encoding": encoding})
