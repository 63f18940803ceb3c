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
        self._flushing = False

    async def append(self, stream: str, fields: dict[bytes, bytes]) -> bytes:
        """The entry's id, once the entry is in Redis; raises RedisError otherwise."""
        future: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self._queue.append((stream, fields, future))
        if not self._flushing:
            self._flushing = True
            asyncio.get_running_loop().create_task(self._flush())
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
                except (RedisError, asyncio.CancelledError) as exc:
                    failure = exc if isinstance(exc, RedisError) else RedisError("cancelled")
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
            self._flushing = False
