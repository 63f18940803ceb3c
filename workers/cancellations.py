"""A worker's view of its model's cancelled requests (:mod:`sluice.core.cancellation`).

:class:`CancelWatch` follows the model's cancellation stream with one blocking read (it
wakes when a notice arrives, else every :data:`_BLOCK_MS`), and remembers each
cancelled request for :data:`REMEMBER_S`. Before a batch computes, its requests that were
cancelled meanwhile are taken out (:meth:`CancelWatch.cancelled`): one set lookup per
request. A request computing now on behalf of which this worker makes requests of its own
(an ensemble's steps, a Python model's BLS calls) registers a callback
(:meth:`CancelWatch.on_cancel`) that stops those requests, which in turn withdraws them from
their models' queues.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable

from redis.asyncio import Redis
from redis.exceptions import RedisError

from sluice.core.cancellation import parse_notice, request_identity
from sluice.core.keys import Keys
from sluice.core.redis_client.types import StreamRead
from sluice.core.wire import RequestMessage

log = logging.getLogger(__name__)

REMEMBER_S = 600.0
"""How long a cancelled request is remembered: longer than any entry waits unread in a
worker's hands, and the notices of that long ago are read again by a worker that starts."""

_REMEMBER_MAX = 100_000
"""Cancelled requests remembered at most (the oldest are forgotten first)."""

_BLOCK_MS = 5_000
BLOCK_S = _BLOCK_MS / 1000
"""The longest one read of notices waits."""
"""One read of the notices waits this long (under the worker's Redis socket timeout); it
returns as soon as a notice arrives."""

Identity = tuple[str, str]


class CancelWatch:
    def __init__(
        self, redis: Redis, keys: Keys, model: str, stopping: asyncio.Event | None = None
    ) -> None:
        """``stopping``: :meth:`follow` returns once it is set and its blocked read has
        ended (the worker unblocks it), rather than being cancelled in the middle of a
        read: redis-py can be left waiting for good by a cancellation that lands as a
        blocked read is unblocked, and the worker would never exit."""
        self._redis = redis
        self._stopping = stopping or asyncio.Event()
        self._stream = keys.cancellations(model)
        self._cancelled: OrderedDict[Identity, float] = OrderedDict()
        self._callbacks: dict[Identity, list[Callable[[], None]]] = {}

    def cancelled(self, message: RequestMessage) -> bool:
        """Whether the caller of ``message`` went away."""
        if not self._cancelled:
            return False
        return request_identity(message.reply_to, message.request_key) in self._cancelled

    def on_cancel(
        self, message: RequestMessage, callback: Callable[[], None]
    ) -> Callable[[], None]:
        """Call ``callback`` (on the event loop) if ``message``'s request is cancelled from
        now on (at once if it was already); returns what forgets the callback again."""
        identity = request_identity(message.reply_to, message.request_key)
        if identity in self._cancelled:
            callback()
            return lambda: None
        self._callbacks.setdefault(identity, []).append(callback)

        def forget() -> None:
            callbacks = self._callbacks.get(identity)
            if callbacks is not None:
                with contextlib.suppress(ValueError):
                    callbacks.remove(callback)
                if not callbacks:
                    del self._callbacks[identity]

        return forget

    def note(self, identity: Identity, now: float) -> None:
        """A notice was read: remember it, and stop what works on its behalf."""
        self._cancelled[identity] = now
        self._cancelled.move_to_end(identity)
        while len(self._cancelled) > _REMEMBER_MAX:
            self._cancelled.popitem(last=False)
        for callback in self._callbacks.pop(identity, ()):
            try:
                callback()
            except Exception:
                log.exception("stopping the work of a cancelled request failed")

    def forget_old(self, now: float) -> None:
        while self._cancelled:
            identity, seen = next(iter(self._cancelled.items()))
            if now - seen < REMEMBER_S:
                break
            del self._cancelled[identity]

    async def follow(self) -> None:
        """Read notices until stopped (the worker's background task)."""
        since_ms = int((time.time() - REMEMBER_S) * 1000)
        last_id: bytes | str = f"{max(0, since_ms)}-0"
        while not self._stopping.is_set():
            try:
                response: StreamRead = await self._redis.xread(  # type: ignore[assignment]
                    {self._stream: last_id}, count=1000, block=_BLOCK_MS
                )
            except RedisError as exc:
                log.debug("reading cancellation notices failed: %s", exc)
                await asyncio.sleep(1.0)
                continue
            now = time.monotonic()
            for _stream, entries in response or ():
                for entry_id, fields in entries:
                    last_id = entry_id
                    identity = parse_notice(fields)
                    if identity is not None:
                        self.note(identity, now)
            self.forget_old(now)
