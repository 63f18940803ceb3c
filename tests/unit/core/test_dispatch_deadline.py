"""A request never outlives its deadline, whatever the queue's client does: an append that
hangs (a Redis that accepted the connection and never answers) ends at the deadline with
504's error, and an append that fails in a way the client did not foresee fails the
request (503) instead of leaving it waiting for good."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from redis.exceptions import RedisError

from sluice.core.dispatch import RedisDispatcher
from sluice.core.errors import DeadlineExceeded, Unavailable
from sluice.core.keys import Keys
from sluice.core.redis_client.coalescer import AppendCoalescer
from sluice.core.wire import RequestMessage


class _Pipeline:
    def __init__(self, execute: Any) -> None:
        self.execute = execute

    async def __aenter__(self) -> _Pipeline:
        return self

    async def __aexit__(self, *_: object) -> None:
        return None

    def xadd(self, *_: object, **__: object) -> None:
        return None


class _Redis:
    """Answers pipelines with ``execute``."""

    def __init__(self, execute: Any) -> None:
        self._execute = execute

    def pipeline(self, transaction: bool = False) -> _Pipeline:
        return _Pipeline(self._execute)


def _dispatcher(execute: Any) -> RedisDispatcher:
    redis: Any = _Redis(execute)
    return RedisDispatcher(redis, redis, Keys("t"), stream_max_len=10)


async def _never() -> list[bytes]:
    """A pipeline that never answers."""
    await asyncio.Event().wait()
    return []


def _message() -> RequestMessage:
    return RequestMessage(request_key="", reply_to="", inputs=[], outputs=[])


def test_an_append_that_never_returns_ends_at_the_deadline() -> None:
    async def run() -> float:
        dispatcher = _dispatcher(_never)
        started = time.monotonic()
        with pytest.raises(DeadlineExceeded, match=r"within 0\.200 s"):
            await dispatcher.submit("m", "s", _message(), b"", timeout_s=0.2)
        assert dispatcher.expired["s"] == 1
        return time.monotonic() - started

    assert asyncio.run(run()) < 2.0  # (0.2 s; ten times that on a busy machine)


def test_a_decoupled_request_also_ends_at_its_deadline_while_appending() -> None:
    async def run() -> None:
        dispatcher = _dispatcher(_never)
        with pytest.raises(DeadlineExceeded):
            async for _ in dispatcher.submit_stream("m", "s", _message(), b"", timeout_s=0.2):
                pass

    asyncio.run(run())


def test_an_unforeseen_failure_of_the_client_fails_the_request() -> None:
    async def broken() -> list[bytes]:
        raise ValueError("not a RedisError")

    async def run() -> None:
        dispatcher = _dispatcher(broken)
        with pytest.raises(Unavailable, match="unreachable"):
            await dispatcher.submit("m", "s", _message(), b"", timeout_s=5)

    asyncio.run(run())


def test_the_coalescer_fails_every_waiter_of_a_failed_pipeline_and_goes_on() -> None:
    calls: list[int] = []

    async def flaky() -> list[bytes]:
        calls.append(1)
        if len(calls) == 1:
            raise RedisError("gone")
        return [b"1-1"]

    async def run() -> None:
        redis: Any = _Redis(flaky)
        coalescer = AppendCoalescer(redis, 10)
        with pytest.raises(RedisError):
            await coalescer.append("s", {b"a": b"b"})
        assert await coalescer.append("s", {b"a": b"b"}) == b"1-1"

    asyncio.run(run())
