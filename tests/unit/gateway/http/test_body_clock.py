"""The body's time limit charges the client only while the server reads.

A real uvicorn with the gateway's protocol on a loopback port, and an application that
takes the body slowly: the server, not the client, is the slow one, so the request must
be answered however long the server took, while a body that trickles in is still cut off.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import uvicorn

from sluice.gateway.http.protocol import bounded_protocol

BODY_TIMEOUT_S = 0.25
SLOW_READ_S = 0.1
"""The application's pause before each read: eight or more reads of a 2 MiB body take
at least 0.8 s, three times the body's limit, while the client has sent everything."""
BODY = b"x" * (2 << 20)


async def _slow_reader(scope: Any, receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    received = 0
    more = True
    while more:
        await asyncio.sleep(SLOW_READ_S)
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        received += len(message["body"])
        more = message.get("more_body", False)
    answer = str(received).encode()
    headers = [(b"content-length", str(len(answer)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": answer})


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    protocol = bounded_protocol(
        header_timeout_s=5.0, body_timeout_s=BODY_TIMEOUT_S, send_timeout_s=5.0, max_connections=8
    )
    config = uvicorn.Config(
        _slow_reader, http=protocol, lifespan="off", log_config=None, log_level="warning"
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield listener.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(30)
        listener.close()


def _read_all(sock: socket.socket) -> bytes:
    chunks = []
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def _post_head(length: int) -> bytes:
    head = f"POST / HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: {length}\r\n"
    return head.encode() + b"\r\n"


@pytest.mark.slow
def test_a_body_sent_at_once_is_answered_however_slowly_the_server_reads(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        started = time.monotonic()
        sock.sendall(_post_head(len(BODY)) + BODY)
        answer = _read_all(sock)
        took = time.monotonic() - started
    assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
    assert answer.endswith(str(len(BODY)).encode())
    assert took > 2 * BODY_TIMEOUT_S  # the server really was the slow one


def test_a_body_that_trickles_is_still_cut_off(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(_post_head(1000))
        started = time.monotonic()
        for _ in range(1000):
            try:
                sock.sendall(b"x")
            except (BrokenPipeError, ConnectionResetError):
                break
            time.sleep(0.02)
            if time.monotonic() - started > 40 * BODY_TIMEOUT_S:
                break
        answer = _read_all(sock)
        waited = time.monotonic() - started
    assert answer == b"", answer[:200]
    assert waited < 20 * BODY_TIMEOUT_S
