"""One worker process: one instance of one model version.

The loop blocks for the first request, then keeps filling the batch until it
is full, reaches a preferred size, or the first request has waited
``max_queue_delay`` and the compute thread is free. While one batch computes
on the compute thread, the event loop already gathers the next. Answers are
published, and entries acknowledged, in one pipelined round trip per batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import signal
import socket
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from redis.asyncio import Redis
from redis.exceptions import RedisError, ResponseError

from sluice import statistics as st
from sluice.config import ModelConfig
from sluice.errors import DeadlineExceeded, InferenceFailed, SluiceError, error_kind
from sluice.keys import WORKER_GROUP, Keys, load_error_field
from sluice.settings import WorkerSettings
from sluice.wire import MalformedEntry, ReplyMessage, TensorHeader, decode_request, encode_reply
from workers.backends import load_backend
from workers.backends.base import Backend, Placement
from workers.batching import (
    PendingRequest,
    combine,
    output_names,
    request_items,
    shape_key,
    split,
    validate,
)
from workers.warmup import warm_up

log = logging.getLogger(__name__)

EXIT_LOAD_FAILED = 3
"""Exit status of a worker whose model cannot load: the supervisor does not respawn it."""

_IDLE_BLOCK_MS = 500
_PUBLISH_ATTEMPTS = 5


@dataclass(slots=True)
class _Outcome:
    request: PendingRequest
    reply: ReplyMessage
    payload: bytes = b""


@dataclass(slots=True)
class _Timing:
    input_ns: int = 0
    infer_ns: int = 0
    output_ns: int = 0
    started_ns: int = 0


class Worker:
    def __init__(
        self,
        settings: WorkerSettings,
        config: ModelConfig,
        version: int,
        model_path: Path,
        placement: Placement,
        *,
        drain: bool = False,
    ) -> None:
        """``drain``: :meth:`run` returns once the stream is empty (tests, batch runs)."""
        self.settings = settings
        self.config = config
        self.version = version
        self.model_path = model_path
        self.placement = placement
        self.drain = drain
        self.keys = Keys(settings.namespace)
        self.stream = self.keys.request_stream(config.name, version)
        self.worker_id = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self._stopping = asyncio.Event()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="compute")
        self._compute_ewma_s = 0.001
        self._redis: Redis | None = None

    def stop(self) -> None:
        """Finish the current batch, answer it, acknowledge it, then return from :meth:`run`."""
        self._stopping.set()

    @property
    def redis(self) -> Redis:
        assert self._redis is not None
        return self._redis

    async def run(self) -> int:
        self._redis = Redis.from_url(self.settings.redis_url)
        try:
            return await self._run()
        finally:
            await self._redis.aclose()
            self._executor.shutdown(wait=True)

    async def _run(self) -> int:
        error_field = load_error_field(self.config.name, self.version)
        try:
            backend = await asyncio.get_running_loop().run_in_executor(
                self._executor, self._load_and_warm_up
            )
        except Exception as exc:
            reason = exc.message if isinstance(exc, SluiceError) else f"{type(exc).__name__}: {exc}"
            log.error("cannot load %s version %d: %s", self.config.name, self.version, reason)
            await self.redis.hset(self.keys.load_errors, error_field, reason)
            return EXIT_LOAD_FAILED
        await self.redis.hdel(self.keys.load_errors, error_field)
        await self._ensure_group()
        heartbeat = asyncio.create_task(self._heartbeat(), name="heartbeat")
        try:
            await self._serve(backend)
        finally:
            heartbeat.cancel()
            await asyncio.gather(heartbeat, return_exceptions=True)
            with contextlib.suppress(RedisError):
                live = self.keys.live_workers(self.config.name, self.version)
                await self.redis.zrem(live, self.worker_id)
            backend.close()
        return 0

    def _load_and_warm_up(self) -> Backend:
        backend = load_backend(self.config, self.model_path, self.placement)
        try:
            warm_up(backend, self.config, self.model_path.parent.parent)
        except BaseException:
            backend.close()
            raise
        return backend

    async def _ensure_group(self) -> None:
        try:
            await self.redis.xgroup_create(self.stream, WORKER_GROUP, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def _heartbeat(self) -> None:
        key = self.keys.live_workers(self.config.name, self.version)
        while True:
            try:
                now = time.time()
                async with self.redis.pipeline(transaction=False) as pipe:
                    pipe.zadd(key, {self.worker_id: now + 3 * self.settings.heartbeat_s})
                    pipe.zremrangebyscore(key, "-inf", now)
                    await pipe.execute()
            except RedisError as exc:
                log.warning("heartbeat failed: %s", exc)
            await asyncio.sleep(self.settings.heartbeat_s)

    # -- batch formation -------------------------------------------------------------------

    async def _serve(self, backend: Backend) -> None:
        idle = asyncio.Event()
        idle.set()
        carry: list[PendingRequest] = []
        running: set[asyncio.Task[None]] = set()
        while True:
            batch, carry = await self._gather(carry, idle)
            if batch:
                await idle.wait()
                idle.clear()
                task = asyncio.create_task(self._execute(batch, backend))
                running.add(task)
                task.add_done_callback(running.discard)
                task.add_done_callback(lambda _: idle.set())
            elif self._stopping.is_set() or (self.drain and not running and not carry):
                break
        if running:
            await asyncio.gather(*running)

    async def _read(self, count: int, block_ms: int | None) -> list[PendingRequest]:
        try:
            response = await self.redis.xreadgroup(
                WORKER_GROUP,
                self.worker_id,
                {self.stream: ">"},
                count=max(1, count),
                block=block_ms,
            )
        except RedisError as exc:
            log.warning("reading %s failed: %s", self.stream, exc)
            await asyncio.sleep(0.5)
            return []
        pending: list[PendingRequest] = []
        rejected: list[_Outcome] = []
        for _stream, entries in response or ():
            for entry_id, fields in entries:
                parsed = self._parse(entry_id, fields)
                if isinstance(parsed, _Outcome):
                    rejected.append(parsed)
                elif parsed is not None:
                    pending.append(parsed)
        if rejected:
            await self._publish(rejected, None, 0)
        return pending

    def _parse(
        self, entry_id: bytes, fields: dict[bytes, bytes]
    ) -> PendingRequest | _Outcome | None:
        try:
            message, payload = decode_request(fields)
        except MalformedEntry as exc:
            log.error("dropping malformed entry %s: %s", entry_id, exc)
            asyncio.get_running_loop().create_task(self._discard(entry_id))
            return None
        request = PendingRequest(entry_id, message, payload, 1, ())
        try:
            validate(message, self.config)
            request.items = request_items(message, self.config)
            request.key = shape_key(message, self.config)
        except SluiceError as exc:
            return _Outcome(request, self._error_reply(message.request_key, exc))
        return request

    async def _discard(self, entry_id: bytes) -> None:
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.xack(self.stream, WORKER_GROUP, entry_id)
            pipe.xdel(self.stream, entry_id)
            await pipe.execute()

    def _select(
        self, pending: list[PendingRequest]
    ) -> tuple[list[PendingRequest], list[PendingRequest], bool]:
        """The next batch (first request's shape, arrival order), the rest, and if it is full."""
        limit = max(1, self.config.max_batch_size)
        key = pending[0].key
        batch: list[PendingRequest] = []
        rest: list[PendingRequest] = []
        items, full = 0, False
        for request in pending:
            if request.key == key and items + request.items <= limit and not full:
                batch.append(request)
                items += request.items
            else:
                if request.key == key:
                    full = True
                rest.append(request)
        if not batch:
            # One request over the limit cannot happen (the gateway checks); never stall anyway.
            batch, rest = [pending[0]], pending[1:]
        return batch, rest, full or items >= limit

    async def _gather(
        self, carry: list[PendingRequest], idle: asyncio.Event
    ) -> tuple[list[PendingRequest], list[PendingRequest]]:
        limit = max(1, self.config.max_batch_size)
        dynamic = self.config.dynamic_batching
        delay_s = dynamic.max_queue_delay_us / 1e6 if dynamic else 0.0
        preferred = set(dynamic.preferred_batch_sizes) if dynamic else set()
        pending = carry
        if not pending:
            if self._stopping.is_set():
                return [], []
            pending = await self._read(limit, None if self.drain else _IDLE_BLOCK_MS)
            if not pending:
                return [], []
        first = time.monotonic()
        while True:
            batch, rest, full = self._select(pending)
            items = sum(r.items for r in batch)
            waited = time.monotonic() - first
            if full or self._stopping.is_set():
                return batch, rest
            if idle.is_set() and (items in preferred or waited >= delay_s):
                return batch, rest
            wait_s = delay_s - waited if waited < delay_s else self._compute_ewma_s / 2
            block_ms = math.ceil(wait_s * 1000) if wait_s >= 0.0005 else None
            more = await self._read(limit - items, block_ms)
            pending = batch + rest + more
            if not more and self.drain and idle.is_set():
                return batch, rest

    # -- execution -------------------------------------------------------------------------

    async def _execute(self, batch: list[PendingRequest], backend: Backend) -> None:
        now_ns = time.time_ns()
        outcomes: list[_Outcome] = []
        live: list[PendingRequest] = []
        for request in batch:
            deadline = request.message.deadline_ns
            if deadline and deadline < now_ns:
                error = DeadlineExceeded("the request's deadline passed while it was queued")
                outcomes.append(
                    _Outcome(request, self._error_reply(request.message.request_key, error))
                )
            else:
                live.append(request)
        timing = _Timing(started_ns=now_ns)
        if live:
            loop = asyncio.get_running_loop()
            started = time.monotonic()
            try:
                results = await loop.run_in_executor(
                    self._executor, self._compute, live, backend, timing
                )
                for request, (headers, payload) in zip(live, results, strict=True):
                    reply = ReplyMessage(request.message.request_key, self.version, headers)
                    outcomes.append(_Outcome(request, reply, payload))
            except Exception as exc:
                error = (
                    exc
                    if isinstance(exc, SluiceError)
                    else InferenceFailed(f"{type(exc).__name__}: {exc}")
                )
                log.warning("batch of %d failed: %s", len(live), error.message)
                outcomes.extend(
                    _Outcome(r, self._error_reply(r.message.request_key, error)) for r in live
                )
            self._compute_ewma_s = 0.8 * self._compute_ewma_s + 0.2 * (time.monotonic() - started)
        await self._publish(outcomes, timing, sum(r.items for r in live))

    def _compute(
        self, batch: list[PendingRequest], backend: Backend, timing: _Timing
    ) -> list[tuple[list[TensorHeader], bytes]]:
        t0 = time.perf_counter_ns()
        inputs = combine(batch, self.config)
        t1 = time.perf_counter_ns()
        outputs = backend.infer(inputs, output_names(batch))
        t2 = time.perf_counter_ns()
        results = split(batch, outputs, self.config)
        t3 = time.perf_counter_ns()
        timing.input_ns, timing.infer_ns, timing.output_ns = t1 - t0, t2 - t1, t3 - t2
        return results

    def _error_reply(self, request_key: str, error: SluiceError) -> ReplyMessage:
        return ReplyMessage(
            request_key, self.version, error_kind=error_kind(error), error=error.message
        )

    async def _publish(self, outcomes: list[_Outcome], timing: _Timing | None, items: int) -> None:
        if not outcomes:
            return
        for attempt in range(_PUBLISH_ATTEMPTS):
            try:
                async with self.redis.pipeline(transaction=False) as pipe:
                    for outcome in outcomes:
                        pipe.xadd(
                            outcome.request.message.reply_to,
                            encode_reply(outcome.reply, outcome.payload),  # type: ignore[arg-type]
                            maxlen=self.settings.reply_max_len,
                            approximate=True,
                        )
                    pipe.xack(self.stream, WORKER_GROUP, *(o.request.entry_id for o in outcomes))
                    self._record_stats(pipe, outcomes, timing, items)
                    await pipe.execute()
                return
            except RedisError as exc:
                log.warning(
                    "publishing %d answers failed (attempt %d): %s", len(outcomes), attempt + 1, exc
                )
                await asyncio.sleep(0.2 * 2**attempt)
        log.error("gave up publishing %d answers; they stay pending for redelivery", len(outcomes))

    def _record_stats(
        self, pipe, outcomes: list[_Outcome], timing: _Timing | None, items: int
    ) -> None:  # type: ignore[no-untyped-def]
        name, version = self.config.name, self.version
        key = self.keys.stats(name, version)
        now_ns = time.time_ns()
        ok = [o for o in outcomes if not o.reply.error_kind]
        failed = [o for o in outcomes if o.reply.error_kind]
        if failed:
            pipe.hincrby(key, st.count_field("fail"), len(failed))
            pipe.hincrby(
                key,
                st.ns_field("fail"),
                sum(now_ns - o.request.message.enqueued_ns for o in failed),
            )
        if not ok or timing is None:
            return
        n = len(ok)
        increments = {
            st.INFERENCE_COUNT: items,
            st.EXECUTION_COUNT: 1,
            st.count_field("success"): n,
            st.ns_field("success"): sum(now_ns - o.request.message.enqueued_ns for o in ok),
            st.count_field("queue"): n,
            st.ns_field("queue"): sum(
                max(0, timing.started_ns - o.request.message.enqueued_ns) for o in ok
            ),
        }
        durations = {
            "compute_input": timing.input_ns,
            "compute_infer": timing.infer_ns,
            "compute_output": timing.output_ns,
        }
        for kind, ns in durations.items():
            increments[st.count_field(kind)] = n
            increments[st.ns_field(kind)] = ns * n
        for field, value in increments.items():
            pipe.hincrby(key, field, value)
        pipe.hset(key, st.LAST_INFERENCE, now_ns // 1_000_000)
        batch_key = self.keys.batch_stats(name, version)
        for kind, ns in durations.items():
            pipe.hincrby(batch_key, st.batch_field(items, kind, "count"), 1)
            pipe.hincrby(batch_key, st.batch_field(items, kind, "ns"), ns)
        pipe.hincrby(self.keys.instance_stats(name, version), self.worker_id, 1)


def install_signal_handlers(worker: Worker) -> None:
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, worker.stop)
