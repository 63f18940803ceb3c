"""A decoupled model's responses reach their waiting request in order, and a client that
reads more slowly than the model answers has its stream ended instead of the gateway's
memory filling up."""

from __future__ import annotations

import asyncio
from typing import Any

from sluice.core import dispatch
from sluice.core.dispatch import RedisDispatcher
from sluice.core.errors import Overloaded
from sluice.core.keys import Keys
from sluice.core.wire import ReplyMessage, RequestMessage, encode_reply


def _dispatcher() -> RedisDispatcher:
    unused: Any = object()  # no Redis call is made here
    return RedisDispatcher(unused, unused, Keys("t"), stream_max_len=10)


def test_responses_queue_in_order_and_a_slow_client_is_cut_off_and_withdrawn(
    monkeypatch: Any,
) -> None:
    monkeypatch.setattr(dispatch, "STREAM_BACKLOG", 3)

    withdrawn: list[str] = []

    async def run() -> tuple[list[Any], list[Any]]:
        dispatcher = _dispatcher()
        queue: asyncio.Queue[Any] = asyncio.Queue()
        dispatcher._streams["7"] = queue
        dispatcher._stream_withdrawals["7"] = lambda: withdrawn.append("7")
        for index in range(3):
            dispatcher._resolve(encode_reply(ReplyMessage("7", index, final=False)))
        read = [queue.get_nowait() for _ in range(queue.qsize())]
        for index in range(3, 7):  # 3, 4, 5 wait; 6 is one too many
            dispatcher._resolve(encode_reply(ReplyMessage("7", index, final=False)))
        return read, [queue.get_nowait() for _ in range(queue.qsize())]

    read, items = asyncio.run(run())
    assert [item[0].model_version for item in read] == [0, 1, 2]
    # Past the backlog: the stream's next item is the error (what waited is dropped, it
    # would never be read), nothing after it, and the request is withdrawn at once.
    assert len(items) == 1
    assert isinstance(items[0], Overloaded) and "too slowly" in items[0].message
    assert withdrawn == ["7"]


def test_the_final_flag_travels() -> None:
    from sluice.core.wire import decode_reply

    reply, _ = decode_reply(encode_reply(ReplyMessage("1", 2, final=False)))
    assert reply.final is False
    assert decode_reply(encode_reply(ReplyMessage("1", 2)))[0].final is True


def test_a_stream_computed_again_after_its_worker_died_repeats_no_response() -> None:
    """The first worker sent responses 0 and 1, then died; the request's second delivery
    starts over at 0: the client gets 0, 1, 2 and the final one, each once. A response
    without an index (an older worker) is always forwarded."""

    class Appender:
        async def append(self, stream: str, fields: object, appended: object) -> bytes:
            return b"1-0"

    async def run() -> list[tuple[int | None, bool]]:
        dispatcher = _dispatcher()
        dispatcher._appender = Appender()  # type: ignore[assignment]
        message = RequestMessage(request_key="", reply_to="", inputs=[], outputs=[])
        responses = dispatcher.submit_stream("m", "s", message, b"", timeout_s=10)
        got: list[tuple[int | None, bool]] = []
        first = asyncio.ensure_future(anext(responses))
        await asyncio.sleep(0)
        key = message.request_key
        for index in (0, 1, 0, 1, 2, None):
            dispatcher._resolve(encode_reply(ReplyMessage(key, 1, final=False, index=index)))
        dispatcher._resolve(encode_reply(ReplyMessage(key, 1)))
        reply, _ = await first
        got.append((reply.index, reply.final))
        async for reply, _ in responses:
            got.append((reply.index, reply.final))
        return got

    assert asyncio.run(run()) == [(0, False), (1, False), (2, False), (None, False), (None, True)]


def test_a_bad_response_index_is_a_malformed_reply() -> None:
    import msgpack
    import pytest

    from sluice.core.wire import HEADER_FIELD, MalformedEntry, decode_reply

    fields = encode_reply(ReplyMessage("1", 2, final=False, index=3))
    header = msgpack.unpackb(fields[HEADER_FIELD])
    assert header["i"] == 3
    for bad in (-1, "3", True, 1.5):
        header["i"] = bad
        with pytest.raises(MalformedEntry, match="response index"):
            decode_reply({**fields, HEADER_FIELD: msgpack.packb(header)})
