"""A response's head and body leave in one write; nothing is held past the loop's turn."""

from __future__ import annotations

import asyncio
from typing import Any

from sluice.gateway.http.protocol import OneWriteTransport


class RecordingTransport:
    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def get_extra_info(self, name: str) -> Any:
        return ("127.0.0.1", 1) if name == "peername" else None


HEAD = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n"


def _run(scenario: Any) -> RecordingTransport:
    recording = RecordingTransport()

    async def main() -> None:
        transport = OneWriteTransport(recording, asyncio.get_running_loop())  # type: ignore[arg-type]
        await scenario(transport)
        await asyncio.sleep(0)  # one more turn of the loop

    asyncio.run(main())
    return recording


def test_head_and_body_go_in_one_write() -> None:
    async def respond(transport: OneWriteTransport) -> None:
        transport.write(HEAD)
        transport.write(b"{}")

    assert _run(respond).writes == [HEAD + b"{}"]


def test_a_head_without_body_is_written_at_the_end_of_the_turn() -> None:
    async def head_only(transport: OneWriteTransport) -> None:
        transport.write(HEAD)

    assert _run(head_only).writes == [HEAD]


def test_a_large_body_is_not_copied_and_continue_is_not_held() -> None:
    body = b"x" * (1 << 20)

    async def respond(transport: OneWriteTransport) -> None:
        transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        transport.write(HEAD)
        transport.write(body)
        transport.write(b"more")

    writes = _run(respond).writes
    assert writes == [b"HTTP/1.1 100 Continue\r\n\r\n", HEAD, body, b"more"]


def test_closing_writes_what_is_held_first_and_delegates_the_rest() -> None:
    async def close(transport: OneWriteTransport) -> None:
        transport.write(HEAD)
        transport.close()
        assert transport.get_extra_info("peername") == ("127.0.0.1", 1)

    recording = _run(close)
    assert recording.writes == [HEAD] and recording.closed
