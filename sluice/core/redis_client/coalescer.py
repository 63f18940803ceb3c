"""Coalescing Redis commands: the operations of all requests that arrive while one
pipeline is in flight go together in the next, so one connection and one round trip carry
many requests under load, and a lone request still goes at once.

:class:`Coalescer` is the mechanism (queueing, one flushing task, every waiter answered or
failed whatever happens); :class:`AppendCoalescer` uses it for the request streams' XADDs,
and the response cache (:mod:`sluice.core.response_cache`) for its lookups, insertions
and statistics."""

from __future__ import annotations

import asyncio
import logging
from typing import Generic, TypeVar

from redis.asyncio import Redis
from redis.exceptions import RedisError

log = logging.getLogger(__name__)

Op = TypeVar("Op")
R = TypeVar("R")


class Coalescer(Generic[Op, R]):
    """Operations submitted while a pipeline is in flight go in the next one
    (:meth:`_send`, which subclasses write)."""

    what = "a pipeline"
    """What failed, in the error a waiter gets when the pipeline itself could not go."""

    def __init__(self) -> None:
        self._pending: list[tuple[Op, asyncio.Future[R]]] = []
        self._flushing: asyncio.Task[None] | None = None
        """The task that sends the pipelines (held: the loop keeps only weak references)."""

    def submit(self, op: Op, future: asyncio.Future[R] | None = None) -> asyncio.Future[R]:
        """``op`` queued for the next pipeline; its result (or RedisError) comes through
        ``future`` (made here unless given: the caller may fail it first to stop waiting)."""
        loop = asyncio.get_running_loop()
        if future is None:
            future = loop.create_future()
        self._pending.append((op, future))
        if self._flushing is None:
            self._flushing = loop.create_task(self._flush())
        return future

    async def _send(self, ops: list[Op]) -> list[R | Exception]:
        """One pipeline for ``ops``: each one's result in order (an exception for one that
        failed alone); raises when the pipeline failed as a whole."""
        raise NotImplementedError

    async def _flush(self) -> None:
        try:
            while self._pending:
                batch, self._pending = self._pending, []
                try:
                    results = await self._send([op for op, _ in batch])
                except (Exception, asyncio.CancelledError) as exc:
                    failure = self._failure(exc, len(batch))
                    for _, future in batch:
                        if not future.done():
                            future.set_exception(failure)
                    if isinstance(exc, asyncio.CancelledError):
                        raise
                    continue
                for (_, future), result in zip(batch, results, strict=True):
                    if future.done():
                        continue
                    if isinstance(result, Exception):
                        failed = result if isinstance(result, RedisError) else RedisError(result)
                        future.set_exception(failed)
                    else:
                        future.set_result(result)
        finally:
            self._flushing = None

    def _failure(self, exc: BaseException, count: int) -> RedisError:
        """What every waiter of a failed pipeline gets: no waiter may be left waiting,
        whatever the client raised."""
        if isinstance(exc, RedisError):
            return exc
        if not isinstance(exc, asyncio.CancelledError):
            log.exception("%s of %d operation(s) failed", self.what, count)
        return RedisError(f"{self.what} failed: {type(exc).__name__}")


class AppendCoalescer(Coalescer[tuple[str, dict[bytes, bytes]], bytes]):
    """The request streams' XADDs, each trimmed to about ``max_len`` entries."""

    what = "appending"

    def __init__(self, redis: Redis, max_len: int) -> None:
        super().__init__()
        self._redis = redis
        self._max_len = max_len

    async def append(
        self,
        stream: str,
        fields: dict[bytes, bytes],
        future: asyncio.Future[bytes] | None = None,
    ) -> bytes:
        """The entry's id, once the entry is in Redis; raises RedisError otherwise.
        ``future``: the one to answer through, which the caller may fail first (its
        deadline passed) to stop waiting; the entry may still be appended."""
        return await self.submit((stream, fields), future)

    async def _send(self, ops: list[tuple[str, dict[bytes, bytes]]]) -> list[bytes | Exception]:
        async with self._redis.pipeline(transaction=False) as pipe:
            for stream, fields in ops:
                pipe.xadd(stream, fields, maxlen=self._max_len, approximate=True)  # type: ignore[arg-type]
            return list(await pipe.execute())
