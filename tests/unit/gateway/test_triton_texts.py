"""Triton's status codes and error texts where its clients and tests match on them, in
process (no Redis, no worker: the dispatcher answers itself, see
:mod:`tests.unit.gateway.in_process`); and the HTTP protocol's reading of chunked bodies
that also carry a Content-Length, against a real uvicorn server on a loopback port."""

from __future__ import annotations

import asyncio
import gzip
import socket
import uuid
import zlib
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import httpx
import numpy as np
import orjson
import pytest
import uvicorn

from sluice.core.datatypes import serialize_bytes
from sluice.core.errors import InvalidInput, PayloadTooLarge
from sluice.core.settings import GatewaySettings
from sluice.core.shm import SHM_DIR
from sluice.gateway.http.body import INLINE_DECODED_BYTES, decode_body, decoded_body
from sluice.gateway.http.model_control_routes import file_content
from sluice.gateway.http.protocol import bounded_protocol
from tests.support.onnx_models import identity_config
from tests.unit.gateway.in_process import EchoDispatcher, in_process_gateway

MODEL = "m"
INFER = f"/v2/models/{MODEL}/infer"
BIG = 2**60 + 2


def gateway(
    datatypes: Sequence[str],
    dims: Sequence[int] = (-1,),
    *,
    max_batch_size: int = 8,
    settings: GatewaySettings | None = None,
) -> httpx.AsyncClient:
    """A client of an in-process gateway serving identity model ``m`` (inputs ``IN_<dt>``,
    outputs ``OUT_<dt>``)."""
    dispatcher = EchoDispatcher([f"OUT_{dt}" for dt in datatypes])
    config = identity_config(MODEL, datatypes, dims, max_batch_size)
    app = in_process_gateway(MODEL, config, dispatcher, settings)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway")


def error(response: httpx.Response, status: int) -> str:
    assert response.status_code == status, response.text
    message = response.json()["error"]
    assert isinstance(message, str)
    return message


def json_input(shape: list[int], data: Any, datatype: str = "FP32") -> dict[str, Any]:
    return {
        "inputs": [{"name": f"IN_{datatype}", "shape": shape, "datatype": datatype, "data": data}]
    }


def nest(value: Any, levels: int) -> Any:
    for _ in range(levels):
        value = [value]
    return value


# ------------------------------------------------------------ 1. sizes beyond 64 bits


async def test_an_element_count_past_int64_is_a_400_before_the_batch_size_is_looked_at() -> None:
    async with gateway(["FP32"]) as client:
        # 16 x (2^60 + 2) elements: past 2^63 - 1 (and a batch of 16 > 8: not what is said).
        response = await client.post(INFER, json=json_input([16, BIG], [1.0]))
        message = error(response, 400)
        assert "causes total element count to exceed maximum size of" in message
        assert message.startswith(f"input 'IN_FP32': the shape [16,{BIG}] causes")
        # 4 x (2^60 + 2) elements fit; their 4-byte FP32 values do not.
        message = error(await client.post(INFER, json=json_input([4, BIG], [1.0])), 400)
        assert message.startswith("byte size overflow for input 'IN_FP32'")
        # One dim of 0: no elements at all, whatever the others (Sluice's own limits then).
        message = error(await client.post(INFER, json=json_input([0, BIG, BIG], [])), 400)
        assert "total element count" not in message and "overflow" not in message


async def test_bytes_count_only_their_elements_and_a_long_shape_is_refused_at_once() -> None:
    async with gateway(["BYTES"]) as client:
        # BYTES have no fixed size: only the element count can overflow.
        message = error(await client.post(INFER, json=json_input([4, BIG], ["a"], "BYTES")), 400)
        assert "overflow" not in message and "total element count" not in message
        message = error(await client.post(INFER, json=json_input([16, BIG], ["a"], "BYTES")), 400)
        assert "causes total element count to exceed maximum size of" in message
        # 100,000 dims: more than any tensor holds, refused before they are read (Triton
        # reads them all, and names them all in its overflow text).
        body = json_input([2] * 100_000, ["a"], "BYTES")
        message = error(await client.post(INFER, json=body), 400)
        assert message == "input 'IN_BYTES': 'shape' has 100000 dims, more than the limit of 64"


async def test_a_negative_dimension_is_a_400_naming_it() -> None:
    """Triton answers 500 ("Unable to parse 'shape': ..."): see docs/differences.md."""
    async with gateway(["FP32"]) as client:
        message = error(await client.post(INFER, json=json_input([2, -5], [1.0])), 400)
        assert message == "input 'IN_FP32': 'shape' dim 1 must be a non-negative integer, got -5"


# ------------------------------------------------------------ 2. JSON nesting depth


@pytest.mark.parametrize(("datatype", "value"), [("BYTES", "hello"), ("INT64", 123)])
async def test_json_data_nested_50_deep_works_and_120_deep_is_tritons_400(
    datatype: str, value: Any
) -> None:
    async with gateway([datatype], (1,)) as client:
        response = await client.post(INFER, json=json_input([1, 1], nest(value, 50), datatype))
        assert response.status_code == 200, response.text
        assert response.json()["outputs"][0]["data"] == [value]
        response = await client.post(INFER, json=json_input([1, 1], nest(value, 120), datatype))
        message = error(response, 400)
        assert "JSON nesting depth exceeds maximum allowed limit (100)" in message
        assert f"input 'IN_{datatype}': 'data' is nested deeper than 100 levels" in message


async def test_nesting_past_what_the_json_parser_takes_gets_the_same_text() -> None:
    deep = b'{"inputs": [{"name": "IN_FP32", "shape": [1, 1], "datatype": "FP32", "data": '
    deep += b"[" * 5000 + b"0.5" + b"]" * 5000 + b"}]}"
    async with gateway(["FP32"]) as client:
        message = error(await client.post(INFER, content=deep), 400)
    assert message.startswith("Unable to parse 'data': JSON nesting depth exceeds maximum allowed")
    assert "malformed request body: depth limit exceeded" in message


# ------------------------------------------------------------ 3. repository index


async def test_repository_index_ready_must_be_a_boolean() -> None:
    async with gateway(["FP32"]) as client:
        for ready in ("yes", 1, None, [True]):
            response = await client.post("/v2/repository/index", json={"ready": ready})
            message = error(response, 400)
            assert message.startswith("Invalid value for 'ready': expected a boolean; got ")
        response = await client.post("/v2/repository/index", json={"ready": True})
        assert response.status_code == 200, response.text
        assert [row["name"] for row in response.json()] == [MODEL]


# ------------------------------------------------------------ 4. shared memory


@pytest.fixture
def shm_key() -> Iterator[str]:
    """A client's POSIX shm object of 4 KiB under /dev/shm."""
    key = f"/tritontexts-{uuid.uuid4().hex}"
    path = SHM_DIR / key[1:]
    path.write_bytes(bytes(4096))
    yield key
    path.unlink(missing_ok=True)


def register(key: Any, byte_size: int, offset: int = 0) -> dict[str, Any]:
    return {"key": key, "offset": offset, "byte_size": byte_size}


def shm_request(region: str, offset: int, byte_size: int = 16) -> dict[str, Any]:
    parameters = {
        "shared_memory_region": region,
        "shared_memory_offset": offset,
        "shared_memory_byte_size": byte_size,
    }
    tensor = {"name": "IN_FP32", "shape": [1, byte_size // 4], "datatype": "FP32"}
    return {"inputs": [tensor | {"parameters": parameters}]}


async def test_registration_beyond_the_object_and_bad_keys(shm_key: str) -> None:
    path = "/v2/systemsharedmemory/region/{}/register"
    async with gateway(["FP32"]) as client:
        response = await client.post(path.format("far"), json=register(shm_key, 8, offset=4096))
        assert error(response, 400).startswith(
            "failed to register shared memory region 'far': invalid args"
        )
        response = await client.post(path.format("long"), json=register(shm_key, 4000, 100))
        assert error(response, 400).startswith(
            "failed to register shared memory region 'long': invalid args"
        )
        for key in ("/a/b", "", "/", "/.."):
            response = await client.post(path.format("bad"), json=register(key, 8))
            assert error(response, 400).startswith(
                f"cannot register shared memory region 'bad' - invalid shm key '{key}'"
            )
        response = await client.post(path.format("typed"), json=register(7, 8))
        assert "'key' must be a string, got integer" in error(response, 400)
        status = await client.get("/v2/systemsharedmemory/status")
        assert status.json() == []


async def test_references_beyond_the_region_get_tritons_texts(shm_key: str) -> None:
    async with gateway(["FP32"]) as client:
        response = await client.post(
            "/v2/systemsharedmemory/region/r/register", json=register(shm_key, 64, offset=1024)
        )
        assert response.status_code == 200, response.text
        inside = await client.post(INFER, json=shm_request("r", 48))
        assert inside.status_code == 200, inside.text
        for offset in (64, 65, 4096, 2**63 - 1):
            message = error(await client.post(INFER, json=shm_request("r", offset)), 400)
            assert message.startswith("Invalid offset for shared memory region: 'r'; "), message
            assert f"input 'IN_FP32': shared memory offset {offset} is beyond the 64 bytes" in (
                message
            )
        for offset in (49, 60):
            message = error(await client.post(INFER, json=shm_request("r", offset)), 400)
            assert message.startswith(
                "Invalid offset + byte size for shared memory region: 'r'; "
            ), message
            assert f"offset {offset} + byte size 16 is beyond the 64 bytes" in message


async def test_client_shared_memory_turned_off_answers_tritons_text(shm_key: str) -> None:
    async with gateway(["FP32"], settings=GatewaySettings(allow_client_shm=False)) as client:
        response = await client.post(
            "/v2/systemsharedmemory/region/r/register", json=register(shm_key, 64)
        )
        message = error(response, 403)
    assert message.startswith(
        "Client shared memory is disabled. Start the server with '--allow-client-shm=true' to "
        "enable; "
    )
    assert "SLUICE_ALLOW_CLIENT_SHM=false" in message


# ------------------------------------------------------------ 5. BYTES that are not UTF-8


def bytes_request(outputs: Any = None, **parameters: Any) -> tuple[bytes, dict[str, str]]:
    raw = serialize_bytes([b"\xff\xfe", b"ok"])
    document: dict[str, Any] = {
        "inputs": [
            {
                "name": "IN_BYTES",
                "shape": [1, 2],
                "datatype": "BYTES",
                "parameters": {"binary_data_size": len(raw)},
            }
        ]
    }
    if outputs is not None:
        document["outputs"] = outputs
    if parameters:
        document["parameters"] = parameters
    header = orjson.dumps(document)
    return header + raw, {"Inference-Header-Content-Length": str(len(header))}


async def test_bytes_that_are_not_utf8_asked_for_as_json_are_a_400() -> None:
    async with gateway(["BYTES"]) as client:
        for outputs, parameters in (
            ([{"name": "OUT_BYTES", "parameters": {"binary_data": False}}], {}),
            (None, {"binary_data_output": False}),
            ([{"name": "OUT_BYTES"}], {"binary_data_output": False}),
        ):
            body, headers = bytes_request(outputs, **parameters)
            message = error(await client.post(INFER, content=body, headers=headers), 400)
            assert message.startswith(
                "Failed to encode using UTF-8. Please use binary_data=True, if you want to pass a "
                "byte array. UnicodeError: output 'OUT_BYTES' element 0: 'utf-8' codec can't "
                "decode byte 0xff"
            ), message
        # Asked for as binary, or not asked for in any form: the bytes, as they are.
        for outputs, parameters in (
            ([{"name": "OUT_BYTES", "parameters": {"binary_data": True}}], {}),
            (
                [{"name": "OUT_BYTES", "parameters": {"binary_data": True}}],
                {"binary_data_output": False},
            ),
            (None, {}),
            ([{"name": "OUT_BYTES"}], {}),
        ):
            body, headers = bytes_request(outputs, **parameters)
            response = await client.post(INFER, content=body, headers=headers)
            assert response.status_code == 200, response.text
            length = int(response.headers["inference-header-content-length"])
            assert response.content[length:] == serialize_bytes([b"\xff\xfe", b"ok"])


# ------------------------------------------------------------ 6. model load files


def test_a_load_file_past_int_max_gets_tritons_text() -> None:
    assert file_content("file:1/model.onnx", "QUJD") == b"ABC"
    with pytest.raises(InvalidInput) as info:
        file_content("file:1/model.onnx", "QUJD", max_encoded=3)
    assert info.value.message.startswith(
        "'file:1/model.onnx' exceeds the maximum allowed data size limit INT_MAX; its base64 "
        "text is 4 characters long"
    )
    with pytest.raises(InvalidInput, match=r"^'file:x' is not valid base64$"):
        file_content("file:x", "Q!JD")
    with pytest.raises(InvalidInput, match="'file:x' must be base64-encoded file content"):
        file_content("file:x", 12)


# ------------------------------------------------------------ 8. raw binary requests


RAW = {"Inference-Header-Content-Length": "0"}


async def test_raw_binary_refusals_have_tritons_texts() -> None:
    async with gateway(["BYTES"]) as client:
        message = error(await client.post(INFER, content=b"427", headers=RAW), 400)
        assert "For BYTE datatype raw input 'IN_BYTES', the model must have input shape [1]" in (
            message
        )
    async with gateway(["FP16"], (-1, -1)) as client:
        body = np.ones([2, 2], np.float16).tobytes()
        message = error(await client.post(INFER, content=body, headers=RAW), 400)
        assert (
            "The shape of the raw input 'IN_FP16' can not be deduced because there are more "
            "than one variable-sized dimension" in message
        )
    async with gateway(["FP32", "INT32", "INT64"]) as client:
        body = np.arange(24, dtype=np.float32).tobytes()
        message = error(await client.post(INFER, content=body, headers=RAW), 400)
        assert "Raw request must only have 1 input (found 1) to be deduced but got 3 inputs in" in (
            message
        )
    async with gateway(["FP32"]) as client:
        body = np.arange(8, dtype=np.float32).tobytes()
        response = await client.post(INFER, content=body, headers=RAW)
        assert response.status_code == 200, response.text
        assert response.content[int(response.headers["inference-header-content-length"]) :] == body


# ------------------------------------------------------------ 9. compressed, chunked bodies


@pytest.fixture
async def served() -> AsyncIterator[int]:
    """A real uvicorn server with Sluice's protocol, in front of the in-process gateway
    (identity model ``m`` on FP32); its port."""
    dispatcher = EchoDispatcher(["OUT_FP32"])
    app = in_process_gateway(MODEL, identity_config(MODEL, ["FP32"], [-1], 8), dispatcher)
    protocol = bounded_protocol(
        header_timeout_s=30, body_timeout_s=30, send_timeout_s=30, max_connections=64
    )
    config = uvicorn.Config(app, http=protocol, lifespan="off", log_level="error")
    server = uvicorn.Server(config)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    task = asyncio.create_task(server.serve(sockets=[listener]))
    try:
        async with asyncio.timeout(30):
            while not server.started:
                await asyncio.sleep(0.01)
        yield listener.getsockname()[1]
    finally:
        server.should_exit = True
        await task


async def exchange(port: int, request: bytes, *, closes: bool) -> bytes:
    """The server's answer (head and body, by its content-length). ``closes``: the server
    must then close the connection, with nothing more written; else it must answer a next
    request on it."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        async with asyncio.timeout(30):
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            answer = head + await reader.readexactly(int(header(head, b"content-length")))
            if closes:
                assert await reader.read() == b""
            else:
                writer.write(b"GET /v2/health/live HTTP/1.1\r\nHost: gateway\r\n\r\n")
                assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200 OK")
    finally:
        writer.close()
    return answer


def header(head: bytes, name: bytes) -> bytes:
    """A header's value in a response's head."""
    for line in head.lower().split(b"\r\n")[1:]:
        key, _, value = line.partition(b":")
        if key == name:
            return value.strip()
    raise AssertionError(f"no {name!r} in {head!r}")


def chunked(body: bytes, size: int = 7) -> bytes:
    parts = [body[i : i + size] for i in range(0, len(body), size)]
    return b"".join(b"%X\r\n%s\r\n" % (len(part), part) for part in parts) + b"0\r\n\r\n"


def post(headers: dict[str, str], content: bytes) -> bytes:
    lines = [f"POST {INFER} HTTP/1.1", "Host: gateway"] + [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + content


def answer_parts(answer: bytes) -> tuple[bytes, bytes, bytes]:
    head, _, body = answer.partition(b"\r\n\r\n")
    return head.split(b"\r\n", 1)[0], head.lower(), body


REQUEST = orjson.dumps(json_input([1, 3], [1.0, 2.0, 3.5]))


async def test_a_chunked_body_with_a_content_length_is_read_by_its_chunks(served: int) -> None:
    """What ``requests`` sends for a body its caller chunked: both headers (Triton reads it)."""
    raw = np.arange(8, dtype=np.float32).tobytes()
    wire = chunked(raw)
    headers = {"Transfer-Encoding": "chunked", "Content-Length": str(len(wire))}
    # RFC 9112 6.3: the connection closes after the answer; nothing after that body is read.
    status, head, body = answer_parts(
        await exchange(served, post(RAW | headers, wire), closes=True)
    )
    assert status == b"HTTP/1.1 200 OK", head
    assert b"connection: close" in head
    assert body[int(header(head, b"inference-header-content-length")) :] == raw


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
async def test_a_compressed_body_sent_chunked_is_decoded(served: int, encoding: str) -> None:
    packed = gzip.compress(REQUEST) if encoding == "gzip" else zlib.compress(REQUEST)
    wire = chunked(packed)
    for extra in ({}, {"Content-Length": str(len(wire))}):
        headers = {"Content-Encoding": encoding, "Transfer-Encoding": "chunked"} | extra
        closes = bool(extra)  # with a Content-Length too: closed after the answer
        answer = await exchange(served, post(headers, wire), closes=closes)
        status, head, body = answer_parts(answer)
        assert status == b"HTTP/1.1 200 OK", (head, body)
        assert orjson.loads(body)["outputs"][0]["data"] == [1.0, 2.0, 3.5]
        assert (b"connection: close" in head) is closes


async def test_bytes_after_a_chunked_body_with_a_length_are_never_a_request(served: int) -> None:
    """A front that went by the Content-Length would send these bytes as part of the body;
    read as a second request they would reach the gateway unseen by it: they are dropped."""
    hidden = b"GET /v2/health/live HTTP/1.1\r\nHost: gateway\r\n\r\n"
    wire = chunked(REQUEST)
    headers = {"Transfer-Encoding": "chunked", "Content-Length": str(len(wire) + len(hidden))}
    answer = await exchange(served, post(headers, wire + hidden), closes=True)
    assert answer.startswith(b"HTTP/1.1 200 OK")  # and nothing after it: no second answer


async def test_large_bodies_are_inflated_whole_and_bounded() -> None:
    inline = INLINE_DECODED_BYTES
    for size in (0, 1, inline - 1, inline, inline + 1, 3 << 20):
        data = bytes(range(256)) * (size // 256) + bytes(size % 256)
        for encoding, packed in (("gzip", gzip.compress(data)), ("deflate", zlib.compress(data))):
            for limit in (size, size + 1, 1 << 30):
                assert await decoded_body(packed, encoding, limit) == data
                assert decode_body(packed, encoding, limit) == data
            if size:
                with pytest.raises(PayloadTooLarge):
                    await decoded_body(packed, encoding, size - 1)
                with pytest.raises(InvalidInput, match="truncated"):
                    await decoded_body(packed[: len(packed) // 2], encoding, 1 << 30)
    bomb = gzip.compress(bytes(64 << 20))  # 64 MiB of zeros in 64 KiB
    with pytest.raises(PayloadTooLarge, match="exceeds the limit of 1048576 bytes"):
        await decoded_body(bomb, "gzip", 1 << 20)
    with pytest.raises(InvalidInput, match="unsupported encoding 'br'"):
        await decoded_body(b"x", "br", 10)
    assert await decoded_body(b"as is", " Identity ", 10) == b"as is"
