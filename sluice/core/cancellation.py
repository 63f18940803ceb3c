"""Cancelling queued requests whose callers went away.

A caller goes away when an HTTP client disconnects, a gRPC call is cancelled or passes its
deadline, a job is cancelled, or an ensemble or BLS call whose parent was cancelled stops.
What the caller's side does (:class:`Withdrawals`), pipelined with other withdrawals:

- ``XDEL`` of the request's entry: still queued, no worker ever reads it (a stream read
  skips deleted entries, and a reclaim drops them);
- a notice on the model's cancellation stream (:meth:`~sluice.core.keys.Keys.cancellations`)
  naming the request by its reply address and key: a worker that already holds the entry
  (read while another batch computed) drops it before computing, and one that computes it
  as an ensemble or BLS parent stops its children (:mod:`sluice.workers.cancellations`).

A request already computing is not interrupted; its answer finds nobody waiting and is
dropped. Notices are trimmed to :data:`NOTICES_MAX_LEN`, so the stream stays small.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping

from redis.asyncio import Redis
from redis.exceptions import RedisError

log = logging.getLogger(__name__)

NOTICES_MAX_LEN = 10_000
"""Approximate length the cancellation stream of a model is trimmed to."""

REPLY_FIELD = b"r"
KEY_FIELD = b"k"


def request_identity(reply_to: str, request_key: str) -> tuple[str, str]:
    """What names a request across processes: its reply address and its key there."""
    return reply_to, request_key


def notice_fields(reply_to: str, request_key: str) -> dict[bytes, bytes]:
    return {REPLY_FIELD: reply_to.encode(), KEY_FIELD: request_key.encode()}


def parse_notice(fields: Mapping[bytes, bytes]) -> tuple[str, str] | None:
    """The request a notice names; None for an entry that is not a notice."""
    try:
        return request_identity(fields[REPLY_FIELD].decode(), fields[KEY_FIELD].decode())
    except (KeyError, UnicodeDecodeError):
        return None


Withdrawal = tuple[str, str, bytes | None, str, str]
"""(notices stream, request stream, entry id or None, reply address, request key)."""


class Withdrawals:
    """Withdraws requests (see the module's docstring) without waiting: those that come
    while one pipeline is in flight go together in the next, so a thousand clients that go
    away at once cost a few round trips on one connection, not a thousand connections."""

    def __init__(self, redis: Redis) -> None:
        self._redis = redis
        self._queue: list[Withdrawal] = []
        self._flushing: asyncio.Task[None] | None = None

    def add(
        self, notices: str, stream: str, entry_id: bytes | None, reply_to: str, request_key: str
    ) -> None:
        self._queue.append((notices, stream, entry_id, reply_to, request_key))
        if self._flushing is None:
            self._flushing = asyncio.get_running_loop().create_task(self._flush())

    async def _flush(self) -> None:
        try:
            while self._queue:
                batch, self._queue = self._queue[:_PIPELINE_MAX], self._queue[_PIPELINE_MAX:]
                try:
                    async with self._redis.pipeline(transaction=False) as pipe:
                        for notices, stream, entry_id, reply_to, request_key in batch:
                            if entry_id is not None:
                                pipe.xdel(stream, entry_id)
                            pipe.xadd(
                                notices,
                                notice_fields(reply_to, request_key),  # type: ignore[arg-type]
                                maxlen=NOTICES_MAX_LEN,
                                approximate=True,
                            )
                        await pipe.execute()
                except RedisError as exc:  # best effort: the deadlines still bound them
                    log.debug("withdrawing %d cancelled requests failed: %s", len(batch), exc)
        finally:
            self._flushing = None


_PIPELINE_MAX = 512
"""Withdrawals sent in one pipeline at most."""
