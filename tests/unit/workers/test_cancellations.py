"""A worker's memory of cancelled requests, and what it stops when one is cancelled."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from sluice.core.keys import Keys
from sluice.core.redis_client.connect import connect_async
from sluice.core.wire import RequestMessage
from sluice.scheduler.executor.redis_server import RedisServer
from sluice.workers.backends.base import CancelSignal
from sluice.workers.cancellations import REMEMBER_S, CancelWatch


def _message(key: str, reply_to: str = "sluice:reply:{g1}") -> RequestMessage:
    return RequestMessage(request_key=key, reply_to=reply_to, inputs=[], outputs=[])


def _watch() -> CancelWatch:
    redis: Any = None  # (following the stream is not exercised here)
    return CancelWatch(redis, Keys("t"), "m")


def test_a_noted_request_is_cancelled_and_others_are_not() -> None:
    watch = _watch()
    assert not watch.cancelled(_message("1"))
    watch.note(("sluice:reply:{g1}", "1"), now=10.0)
    assert watch.cancelled(_message("1"))
    assert not watch.cancelled(_message("2"))
    assert not watch.cancelled(_message("1", reply_to="sluice:reply:{g2}"))  # another gateway's


def test_callbacks_run_once_on_cancel_and_can_be_forgotten() -> None:
    watch = _watch()
    calls: list[str] = []
    watch.on_cancel(_message("1"), lambda: calls.append("one"))
    forget = watch.on_cancel(_message("2"), lambda: calls.append("two"))
    forget()
    watch.note(("sluice:reply:{g1}", "1"), now=1.0)
    watch.note(("sluice:reply:{g1}", "2"), now=1.0)
    watch.note(("sluice:reply:{g1}", "1"), now=1.0)
    assert calls == ["one"]
    # Registered after the notice: runs at once.
    watch.on_cancel(_message("1"), lambda: calls.append("late"))
    assert calls == ["one", "late"]


def test_old_notices_are_forgotten() -> None:
    watch = _watch()
    watch.note(("r", "old"), now=0.0)
    watch.note(("r", "new"), now=REMEMBER_S)
    watch.forget_old(now=REMEMBER_S + 1)
    assert not watch.cancelled(_message("old", "r"))
    assert watch.cancelled(_message("new", "r"))


def test_a_cancel_signal_runs_its_callbacks_once_from_the_setter() -> None:
    signal = CancelSignal()
    calls: list[int] = []
    signal.add(lambda: calls.append(1))
    assert not signal.is_set()
    signal.set()
    signal.add(lambda: calls.append(2))  # already set: at once
    assert signal.is_set() and calls == [1, 2]


async def test_following_ends_when_stopping_is_set_and_its_read_unblocked(
    redis_server: RedisServer,
) -> None:
    """The watch is never cancelled in the middle of a blocked read (redis-py can be left
    waiting for good): once stopping is set, unblocking the read ends it."""
    redis = connect_async(redis_server.url, client_name="watch-test")
    stopping = asyncio.Event()
    watch = CancelWatch(redis, Keys(f"t{uuid.uuid4().hex[:6]}"), "m", stopping)
    following = asyncio.create_task(watch.follow())
    try:
        blocked: list[Any] = []
        for _ in range(100):  # the read blocks within moments
            clients = await redis.client_list()
            blocked = [c for c in clients if c["name"] == "watch-test" and "b" in c["flags"]]
            if blocked:
                break
            await asyncio.sleep(0.05)
        assert blocked, "the watch's read never blocked"
        stopping.set()
        await redis.client_unblock(int(blocked[0]["id"]))
        await asyncio.wait_for(following, timeout=2)  # well before the read's 5 s
    finally:
        following.cancel()
        await redis.aclose()
