"""Submitting requests to a model version's stream and awaiting their replies.

:class:`Dispatcher` is what a caller sees: submit one request message, get its reply.
:class:`RedisDispatcher` appends to the model version's stream and resolves replies that
arrive on its own reply stream, read by one background task (no per-request connection,
no polling). The gateway holds one per process; so does each worker of an ensemble, which
calls its composing models the same way (it lives in ``sluice`` for that reason).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any, Protocol, cast

from redis.asyncio import Redis
from redis.exceptions import RedisError

from sluice.core.cancellation import Withdrawals
from sluice.core.errors import (
    QUEUE_UNREACHABLE,
    DeadlineExceeded,
    Overloaded,
    SluiceError,
    Unavailable,
)
from sluice.core.keys import Keys
from sluice.core.redis_client.coalescer import AppendCoalescer
from sluice.core.redis_client.types import StreamRead
from sluice.core.wire import (
    MalformedEntry,
    ReplyMessage,
    RequestMessage,
    decode_replies,
    encode_request,
)

log = logging.getLogger(__name__)

Reply = tuple[ReplyMessage, memoryview]

STREAM_BACKLOG = 4096
"""Responses of a decoupled model that may wait for one slow client before its stream ends."""

_TRIM_EVERY = 512
"""Answers read between two trims of the reply stream."""

_READ_BLOCK_MS = 4000
"""One read of the reply stream waits this long for answers: it returns as soon as one
arrives, so a longer wait costs no latency; it only wakes an idle reader less often."""

_REPLY_STREAM_TTL_S = 300
"""A reply stream outlives its gateway by this much, then Redis drops it."""


class Dispatcher(Protocol):
    expired: Counter[str]
    """Requests per stream that got no answer within their deadline (for the metrics)."""
    cancelled: Counter[str]
    """Requests per stream whose caller went away before their answer (for the metrics)."""

    async def submit(
        self, model: str, stream: str, message: RequestMessage, payload: bytes, timeout_s: float
    ) -> Reply: ...

    def fail_all(self, error: Exception) -> None: ...

    def mirror(self, stream: str, message: RequestMessage, payload: bytes) -> None: ...

    def submit_stream(
        self, model: str, stream: str, message: RequestMessage, payload: bytes, timeout_s: float
    ) -> AsyncIterator[Reply]: ...


class RedisDispatcher:
    def __init__(
        self,
        redis: Redis,
        reader: Redis,
        keys: Keys,
        *,
        stream_max_len: int,
        on_unclaimed: Callable[[ReplyMessage], None] | None = None,
        caller: str = "",
    ) -> None:
        """``reader`` is a client of its own, so the blocking XREAD never waits behind requests.
        ``on_unclaimed`` sees each reply nobody waits for (timed out, duplicate), so that
        what it references (shared memory segments) can be released. ``caller``: a prefix
        of the reply stream's name saying who reads it (empty for a gateway)."""
        self._on_unclaimed = on_unclaimed
        self._redis = redis
        self._reader_redis = reader
        self._keys = keys
        self._appender = AppendCoalescer(redis, stream_max_len)
        self.gateway_id = caller + uuid.uuid4().hex[:12]
        self.reply_stream = keys.reply_stream(self.gateway_id)
        self._pending: dict[str, asyncio.Future[Reply]] = {}
        self._streams: dict[str, asyncio.Queue[Reply | SluiceError]] = {}
        """Requests to decoupled models: their responses, as they come."""
        self._stream_withdrawals: dict[str, Callable[[], None]] = {}
        """Requests to decoupled models, once queued: what withdraws each, until done."""
        self._counter = itertools.count()
        self._reader: asyncio.Task[None] | None = None
        self.expired: Counter[str] = Counter()
        """Requests that got no answer within their deadline, per stream, since the
        metrics last took them."""
        self.cancelled: Counter[str] = Counter()
        """Requests whose caller went away (the awaiting task was cancelled: a client that
        disconnected, a cancelled gRPC call) before their answer, per stream, since the
        metrics last took them."""
        self._mirrors: set[asyncio.Task[None]] = set()
        self._withdrawals = Withdrawals(redis)

    async def start(self) -> None:
        self._reader = asyncio.create_task(self._read_replies(), name="reply-reader")

    async def stop(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        for future in self._pending.values():
            if not future.done():
                future.set_exception(Unavailable("the gateway is shutting down"))

    def fail_all(self, error: Exception) -> None:
        """Fail every waiting request (Redis went away with their entries)."""
        for future in self._pending.values():
            if not future.done():
                future.set_exception(error)
        failure = error if isinstance(error, SluiceError) else Unavailable(str(error))
        for queue in self._streams.values():
            queue.put_nowait(failure)

    async def submit_stream(
        self, model: str, stream: str, message: RequestMessage, payload: bytes, timeout_s: float
    ) -> AsyncIterator[Reply]:
        """The responses of a decoupled model to one request, in order, until its final one
        (or an error, which ends them); all within ``timeout_s``. Each response once: a
        request delivered again after its worker died starts its responses over, and those
        forwarded already are skipped by their index. Responses that end here before the
        model's final one (the caller went away, the deadline passed, the backlog for a slow
        client overflowed) withdraw the request, so that its model is told to stop."""
        key = str(next(self._counter))
        message.request_key = key
        message.reply_to = self.reply_stream
        message.replies_together = True  # (this reader takes a batch's answers in one entry)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Reply | SluiceError] = asyncio.Queue()
        self._streams[key] = queue
        deadline = loop.time() + timeout_s
        appended: asyncio.Future[bytes] = loop.create_future()
        expiry = loop.call_later(timeout_s, _expire, model, timeout_s, appended)
        entry_id: bytes | None = None
        done = False
        forwarded = 0  # (non-final responses)
        try:
            try:
                entry_id = await self._appender.append(
                    stream, encode_request(message, payload), appended
                )
            except RedisError:
                raise Unavailable(QUEUE_UNREACHABLE) from None
            except DeadlineExceeded:
                self.expired[stream] += 1
                raise
            finally:
                expiry.cancel()
            self._stream_withdrawals[key] = functools.partial(
                self._withdraw, model, stream, entry_id, key, went_away=False
            )
            while True:
                try:
                    item = await asyncio.wait_for(queue.get(), max(0.0, deadline - loop.time()))
                except TimeoutError:
                    self.expired[stream] += 1
                    raise DeadlineExceeded(
                        f"no final answer from model '{model}' within {timeout_s:.3f} s"
                    ) from None
                if isinstance(item, SluiceError):
                    raise item
                reply = item[0]
                done = reply.final or bool(reply.error_kind)
                if not done and reply.index is not None:
                    if reply.index < forwarded:
                        continue  # a repeat: the request's first worker died mid-stream
                    forwarded = reply.index + 1
                yield item
                if done:
                    return
        except (asyncio.CancelledError, GeneratorExit):
            if not done:  # (a caller that stops reading after the last answer cancels nothing)
                self._withdraw(model, stream, entry_id, key)
            raise
        except SluiceError:
            withdraw = self._stream_withdrawals.pop(key, None)
            if not done and withdraw is not None:  # (not the model's own error)
                withdraw()
            raise
        finally:
            self._streams.pop(key, None)
            self._stream_withdrawals.pop(key, None)

    async def submit(
        self, model: str, stream: str, message: RequestMessage, payload: bytes, timeout_s: float
    ) -> Reply:
        key = str(next(self._counter))
        message.request_key = key
        message.reply_to = self.reply_stream
        message.replies_together = True  # (this reader takes a batch's answers in one entry)
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Reply] = loop.create_future()
        appended: asyncio.Future[bytes] = loop.create_future()
        self._pending[key] = future
        # (The deadline also ends the wait for the append: a request never outlives it.)
        expiry = loop.call_later(timeout_s, _expire, model, timeout_s, appended, future)
        entry_id: bytes | None = None
        try:
            try:
                entry_id = await self._appender.append(
                    stream, encode_request(message, payload), appended
                )
            except RedisError:
                raise Unavailable(QUEUE_UNREACHABLE) from None
            return await future
        except DeadlineExceeded:
            self.expired[stream] += 1
            raise
        except asyncio.CancelledError:
            self._withdraw(model, stream, entry_id, key)
            raise
        finally:
            expiry.cancel()
            self._pending.pop(key, None)
            for settled in (future, appended):
                if settled.done() and not settled.cancelled():
                    # Failed (Redis went away, or the deadline passed) while the other one
                    # was awaited: the caller got that one's error; mark this one as seen.
                    settled.exception()

    def _withdraw(
        self,
        model: str,
        stream: str,
        entry_id: bytes | None,
        key: str,
        *,
        went_away: bool = True,
    ) -> None:
        """The caller went away (or, not ``went_away``, its request ended here without an
        answer): take the request back from its stream and tell the model's workers
        (:mod:`sluice.core.cancellation`), without waiting for either."""
        if went_away:
            self.cancelled[stream] += 1
        notices = self._keys.cancellations(model)
        self._withdrawals.add(notices, stream, entry_id, self.reply_stream, key)

    def mirror(self, stream: str, message: RequestMessage, payload: bytes) -> None:
        """Also queue a copy of ``message`` on ``stream`` (shadow traffic): a worker computes
        it and counts it in its version's statistics, and answers nobody (no reply stream;
        every output inline). Does not wait; a failure is only logged."""
        copy = replace(message, request_key="", reply_to="", segment_min_bytes=0)
        fields = encode_request(copy, payload)
        task = asyncio.get_running_loop().create_task(self._mirror(stream, fields))
        self._mirrors.add(task)
        task.add_done_callback(self._mirrors.discard)

    async def _mirror(self, stream: str, fields: dict[bytes, bytes]) -> None:
        try:
            await self._appender.append(stream, fields)
        except RedisError as exc:
            log.debug("mirroring a request to %s failed: %s", stream, exc)

    async def touch(self) -> None:
        """Keep this gateway's reply stream alive; called periodically."""
        await self._redis.expire(self.reply_stream, _REPLY_STREAM_TTL_S)

    async def _read_replies(self) -> None:
        last_id = b"0-0"
        trim: asyncio.Task[object] | None = None
        read_since_trim, trimmed_at = 0, time.monotonic()
        while True:
            try:
                batches = cast(
                    StreamRead,
                    await self._reader_redis.xread(
                        {self.reply_stream: last_id}, count=1024, block=_READ_BLOCK_MS
                    ),
                )
            except asyncio.CancelledError:
                raise
            except RedisError as exc:
                log.warning("reply stream read failed, retrying: %s", exc)
                await asyncio.sleep(0.5)
                continue
            for _stream, entries in batches:
                for entry_id, fields in entries:
                    last_id = entry_id
                    self._resolve(fields)
            read_since_trim += sum(len(entries) for _, entries in batches)
            now = time.monotonic()
            due = read_since_trim >= _TRIM_EVERY or now - trimmed_at >= 1.0
            if read_since_trim and due and (trim is None or trim.done()):
                # Answers are read once: drop them so the reply stream holds only unread ones.
                trim = asyncio.create_task(self._trim(last_id))
                read_since_trim, trimmed_at = 0, now

    async def _trim(self, last_id: bytes) -> None:
        try:
            await self._redis.xtrim(self.reply_stream, minid=_next_id(last_id))
        except RedisError as exc:
            log.debug("trimming the reply stream failed: %s", exc)

    def _resolve(self, fields: dict[bytes, bytes]) -> None:
        try:
            replies = decode_replies(fields)
        except MalformedEntry as exc:
            log.error("dropping malformed reply: %s", exc)
            return
        for reply in replies:
            self._resolve_one(reply)

    def _resolve_one(self, reply: Reply) -> None:
        queue = self._streams.get(reply[0].request_key)
        if queue is not None:
            if queue.qsize() < STREAM_BACKLOG:
                queue.put_nowait(reply)
            else:
                # The client reads slower than the model answers: its stream ends with the
                # error next (what waited is dropped), and the model is told to stop now,
                # not once the stream's reader (which may be waiting for that client)
                # comes back for the next response.
                del self._streams[reply[0].request_key]
                withdraw = self._stream_withdrawals.pop(reply[0].request_key, None)
                if withdraw is not None:
                    withdraw()
                while not queue.empty():
                    queue.get_nowait()
                queue.put_nowait(
                    Overloaded(
                        f"more than {STREAM_BACKLOG} responses waited for a client that reads "
                        "them too slowly; the stream was ended"
                    )
                )
            return
        future = self._pending.get(reply[0].request_key)
        if future is not None and not future.done():
            future.set_result(reply)
        elif self._on_unclaimed is not None:
            self._on_unclaimed(reply[0])


def _next_id(entry_id: bytes) -> str:
    milliseconds, sequence = entry_id.decode().split("-")
    return f"{milliseconds}-{int(sequence) + 1}"


def _expire(model: str, timeout_s: float, *waiting: asyncio.Future[Any]) -> None:
    """The deadline passed: whatever the request still waits for (its append, its answer)
    ends with 504's error."""
    for future in waiting:
        if not future.done():
            future.set_exception(
                DeadlineExceeded(f"no answer from model '{model}' within {timeout_s:.3f} s")
            )
