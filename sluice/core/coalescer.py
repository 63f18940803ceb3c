"""Coalescing stream appends: the XADDs of all requests that arrive while one
pipeline is in flight go together in the next, so one connection and one round
trip carry many requests under load, and a lone request still goes at once."""

from __future__ import annotations

import asyncio
import logging

from redis.asyncio import Redis
from redis.exceptions import RedisError

log = logging.getLogger(__name__)

_Append = tuple[str, dict[bytes, bytes], asyncio.Future[bytes]]


class AppendCoalescer:
    def __init__(self, redis: Redis, max_len: int) -> None:
        self._redis = redis
        self._max_len = max_len
        self._queue: list[_Append] = []
        self._flushing: asyncio.Task[None] | None = None
        """The task that sends the pipelines (held: the loop keeps only weak references)."""

    async def append(
        self,
        stream: str,
        fields: dict[bytes, bytes],
        future: asyncio.Future[bytes] | None = None,
    ) -> bytes:
        """The entry's id, once the entry is in Redis; raises RedisError otherwise.
        ``future``: the one to answer through, which the caller may fail first (its
        deadline passed) to stop waiting; the entry may still be appended."""
        if future is None:
            future = asyncio.get_running_loop().create_future()
        self._queue.append((stream, fields, future))
        if self._flushing is None:
            self._flushing = asyncio.get_running_loop().create_task(self._flush())
        return await future

    async def _flush(self) -> None:
        try:
            while self._queue:
                batch, self._queue = self._queue, []
                try:
                    async with self._redis.pipeline(transaction=False) as pipe:
                        for stream, fields, _ in batch:
                            pipe.xadd(stream, fields, maxlen=self._max_len, approximate=True)  # type: ignore[arg-type]
                        ids = await pipe.execute()
                except (Exception, asyncio.CancelledError) as exc:
                    if isinstance(exc, RedisError):
                        failure = exc
                    else:  # (no waiter may be left waiting, whatever the client raised)
                        if not isinstance(exc, asyncio.CancelledError):
                            log.exception("appending %d request(s) failed", len(batch))
                        failure = RedisError(f"appending failed: {type(exc).__name__}")
                    for _, _, future in batch:
                        if not future.done():
                            future.set_exception(failure)
                    if isinstance(exc, asyncio.CancelledError):
                        raise
                    continue
                for (_, _, future), entry_id in zip(batch, ids, strict=True):
                    if not future.done():
                        future.set_result(entry_id)
        finally:
            self._flushing = None
