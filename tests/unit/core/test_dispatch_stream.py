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
from sluice.core.wire import ReplyMessage, encode_reply


def _dispatcher() -> RedisDispatcher:
    unused: Any = object()  # no Redis call is made here
    return RedisDispatcher(unused, unused, Keys("t"), stream_max_len=10)


def test_responses_queue_in_order_and_a_slow_client_is_cut_off(monkeypatch: Any) -> None:
    monkeypatch.setattr(dispatch, "STREAM_BACKLOG", 3)

    async def run() -> list[Any]:
        dispatcher = _dispatcher()
        queue: asyncio.Queue[Any] = asyncio.Queue()
        dispatcher._streams["7"] = queue
        for index in range(5):
            dispatcher._resolve(encode_reply(ReplyMessage("7", index, final=False)))
        return [queue.get_nowait() for _ in range(queue.qsize())]

    items = asyncio.run(run())
    assert [item[0].model_version for item in items[:3]] == [0, 1, 2]
    assert isinstance(items[3], Overloaded) and "too slowly" in items[3].message
    assert len(items) == 4  # nothing after the cut


def test_the_final_flag_travels() -> None:
    from sluice.core.wire import decode_reply

    reply, _ = decode_reply(encode_reply(ReplyMessage("1", 2, final=False)))
    assert reply.final is False
    assert decode_reply(encode_reply(ReplyMessage("1", 2)))[0].final is True
