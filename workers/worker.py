"""One worker process: one instance of one model version.

The loop blocks for the first request, then keeps filling the batch until it is full,
reaches a preferred size, waiting no longer pays (:mod:`workers.adaptive`), or the first
request has waited ``max_queue_delay``; it goes when the compute thread is free. While
one batch computes on the compute thread, the event loop already gathers the next.
Answers are published, and entries acknowledged, in one pipelined round trip per batch
(see :mod:`workers.replies`) while the next batch computes; requests of dead workers are
taken over by :mod:`workers.reclaim`.
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
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from sluice.core.classification import read_labels
from sluice.core.clock import CLOCK
from sluice.core.config import ModelConfig
from sluice.core.errors import (
    DeadlineExceeded,
    InferenceFailed,
    InvalidConfig,
    InvalidInput,
    SluiceError,
)
from sluice.core.exits import EXIT_LOAD_FAILED, EXIT_SLOT_LOST
from sluice.core.hosts import host_id
from sluice.core.keys import WORKER_GROUP, Keys, load_error_field
from sluice.core.redis_connect import connect_async
from sluice.core.redis_types import StreamRead
from sluice.core.settings import WorkerSettings
from sluice.core.wire import (
    MalformedEntry,
    ReplyMessage,
    RequestMessage,
    TensorHeader,
    decode_request,
)
from sluice.workers import shm_io
from sluice.workers.adaptive import BatchPolicy, batch_policy
from sluice.workers.backends import load_backend
from sluice.workers.backends.base import (
    Backend,
    ConcurrentBackend,
    Placement,
    RequestContext,
    RequestsFailed,
)
from sluice.workers.batching import (
    PendingRequest,
    combine,
    output_names,
    request_items,
    shape_key,
    split,
    validate,
)
from sluice.workers.reclaim import Reclaimer
from sluice.workers.replies import BatchClose, Outcome, Publisher, Timing, error_outcome
from sluice.workers.sequence_book import SequenceBook
from sluice.workers.slot_lease import SlotLease
from sluice.workers.slots import ComputeSlots, backend_concurrency
from sluice.workers.warmup import warm_up

if TYPE_CHECKING:
    from sluice.core.otel import BatchSpan, Tracing

log = logging.getLogger(__name__)

_IDLE_BLOCK_MS = 500
_NO_DEADLINE_NS = 1 << 62
_START_PATIENCE_S = 60.0
"""How long a worker whose model has loaded waits out a Redis outage (a restart, a
Cluster failover) before its first beat, rather than exiting and loading it again."""


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
        tracing: Tracing | None = None,
        slot: int = 0,
    ) -> None:
        """``drain``: :meth:`run` returns once the streams are empty (tests, batch runs).
        ``tracing``: record each batch's spans (see :mod:`sluice.core.otel`); None: no spans.
        ``slot``: which instance of the model this is (a sequence model's instance reads
        the requests of the sequences routed to its slot)."""
        self.tracing = tracing
        self.settings = settings
        self.config = config
        self.version = version
        self.model_path = model_path
        self.placement = placement
        self.drain = drain
        self.keys = Keys(settings.namespace)
        levels = config.dynamic_batching.priority_levels if config.dynamic_batching else 0
        # Online priority levels first, then the background stream (jobs, batch jobs).
        online = (
            [self.keys.sequence_stream(config.name, version, slot)]
            if config.sequence_batching is not None
            else self.keys.request_streams(config.name, version, levels)
        )
        self.streams = [*online, self.keys.background_stream(config.name, version)]
        self.slot = slot
        self._book: SequenceBook | None = None
        """A sequence model's sequences (None for other models)."""
        self._lease: SlotLease | None = None
        """A sequence worker's hold on its slot (:mod:`workers.slot_lease`)."""
        self._background = len(self.streams) - 1
        """The background stream's level (its index)."""
        self.worker_id = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.host = host_id(self.settings.host_id)
        """Advertised with the heartbeat: gateways on this host may send shared memory."""
        shm_io.MAPPINGS.host = self.host
        self._stopping = asyncio.Event()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="compute")
        dynamic = config.dynamic_batching
        self._policy = BatchPolicy(dynamic.max_queue_delay_us / 1e6 if dynamic else 0.0, False)
        """Replaced by the config's own policy (:func:`batch_policy`) once the model loads."""
        self._publish_turn = asyncio.Lock()
        """Held while a batch's answers are published (one batch's at a time)."""
        self._edf = False
        """Requests of one priority level go in deadline order (adaptive batching, unless
        the config asks Triton's ``preserve_ordering``)."""
        self._reclaimed: list[PendingRequest] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        """The worker's event loop (a decoupled model's responses are published on it)."""
        self._redis: Redis | None = None
        self._publisher: Publisher | None = None
        self._labels: dict[str, list[bytes]] = {}
        """Each output's classification labels (its ``label_filename``)."""
        self._concurrency = 1
        """Batches computed at once: the backend's ``concurrency`` (see :mod:`workers.slots`)."""

    def stop(self) -> None:
        """Finish what this worker holds, answer and acknowledge it, then leave :meth:`run`."""
        self._stopping.set()

    @property
    def redis(self) -> Redis:
        assert self._redis is not None
        return self._redis

    @property
    def publisher(self) -> Publisher:
        assert self._publisher is not None
        return self._publisher

    async def run(self) -> int:
        self._loop = asyncio.get_running_loop()
        self._redis = connect_async(self.settings.redis_url, socket_timeout=10)
        self._publisher = Publisher(
            self._redis,
            self.keys,
            self.config.name,
            self.version,
            self.worker_id,
            self.settings.reply_max_len,
            histograms=self.settings.allow_metrics,
        )
        try:
            return await self._run()
        finally:
            await self._redis.aclose()
            self._executor.shutdown(wait=True)

    async def _run(self) -> int:
        error_field = load_error_field(self.config.name, self.version)
        try:
            if self.config.sequence_batching is not None:
                self._book = SequenceBook(
                    self.config, self.model_path.parent.parent, self.redis, self.keys, self.version
                )
                self.publisher.checkpoints = self._book.write_checkpoints
                self.publisher.published = self._book.published
            backend = await asyncio.get_running_loop().run_in_executor(
                self._executor, self._load_and_warm_up
            )
        except Exception as exc:
            reason = exc.message if isinstance(exc, SluiceError) else f"{type(exc).__name__}: {exc}"
            log.error("cannot load %s version %d: %s", self.config.name, self.version, reason)
            # A load on request (explicit model control) reports to its own hash, so that
            # the version still serving is not marked unavailable by its failed successor.
            errors_key = self.settings.load_errors_key or self.keys.load_errors
            await self.redis.hset(errors_key, error_field, reason)
            return EXIT_LOAD_FAILED
        await self._patiently(lambda: self.redis.hdel(self.keys.load_errors, error_field))
        if self._concurrency > 1:
            # One compute thread per batch in flight; the loading thread's pool retires.
            loader, self._executor = (
                self._executor,
                ThreadPoolExecutor(self._concurrency, thread_name_prefix="compute"),
            )
            loader.shutdown(wait=False)
        await self._patiently(self._ensure_groups)
        await self._patiently(self._beat)
        background = [asyncio.create_task(self._heartbeat(), name="heartbeat")]
        try:
            if self._book is not None:
                if not await self._take_slot():
                    return 0  # stopped while standing by
                # What this slot's previous worker held goes first, in order (it is gone:
                # one worker per slot), so each sequence goes on where its checkpoint left it.
                self._reclaimed += await self._reclaimer().take_over(self.streams[0], 0)
            background.append(asyncio.create_task(self._reclaim_loop(), name="reclaim"))
            await self._serve(backend)
        finally:
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
            with contextlib.suppress(RedisError):
                live = self.keys.live_workers(self.config.name, self.version)
                await self.redis.zrem(live, self.worker_id)
                await self.redis.hdel(
                    self.keys.worker_hosts(self.config.name, self.version), self.worker_id
                )
                if self._lease is not None:
                    await self._lease.release()
            backend.close()
        return EXIT_SLOT_LOST if self._lease is not None and self._lease.lost else 0

    async def _take_slot(self) -> bool:
        """Hold this sequence worker's slot, standing by while another worker (another
        host's) serves it; False if asked to stop meanwhile."""
        lease = SlotLease.for_worker(
            self.redis,
            self.keys.sequence_owner(self.config.name, self.version, self.slot),
            self.host,
            self.worker_id,
            3 * self.settings.heartbeat_s,
        )
        announced = False
        while not self._stopping.is_set():
            try:
                if await lease.acquire():
                    self._lease = self.publisher.lease = lease
                    return True
            except RedisError as exc:
                log.warning("cannot take slot %d: %s", self.slot, exc)
            if not announced:
                log.info("slot %d is served by another worker; standing by", self.slot)
                announced = True
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), self.settings.heartbeat_s)
        return False

    def _load_and_warm_up(self) -> Backend:
        self._labels = self._read_labels()
        self._policy = batch_policy(self.config)
        dynamic = self.config.dynamic_batching
        self._edf = self._policy.adaptive and not (dynamic and dynamic.preserve_ordering)
        sequences = self.config.sequence_batching
        if sequences is not None:
            # Arrival order (a sequence's requests must stay in order), the strategy's window.
            self._policy = BatchPolicy(sequences.max_queue_delay_us / 1e6, False)
            self._edf = False
        backend = load_backend(self.config, self.model_path, self.placement)
        if self.config.decoupled and not hasattr(backend, "infer_stream"):
            backend.close()
            raise InvalidConfig(
                f"model '{self.config.name}' is decoupled (model_transaction_policy), which "
                "only Python models can be"
            )
        try:
            self._concurrency = backend_concurrency(backend)
            if not self.config.decoupled:  # (warm-up samples expect one answer each)
                warm_up(backend, self.config, self.model_path.parent.parent)
        except BaseException:
            backend.close()
            raise
        return backend

    def _read_labels(self) -> dict[str, list[bytes]]:
        """As Triton, a ``label_filename`` that cannot be read fails the model's load."""
        labels: dict[str, list[bytes]] = {}
        for spec in self.config.outputs:
            if spec.label_filename:
                path = self.model_path.parent.parent / spec.label_filename
                try:
                    labels[spec.name] = read_labels(path)
                except OSError as exc:
                    raise InvalidConfig(
                        f"output '{spec.name}': cannot read label_filename "
                        f"'{spec.label_filename}': {exc.strerror or exc}"
                    ) from None
        return labels

    async def _patiently(self, step: Callable[[], Awaitable[object]]) -> None:
        """One start-up step against Redis, tried again while Redis cannot be reached (up
        to :data:`_START_PATIENCE_S`)."""
        deadline = time.monotonic() + _START_PATIENCE_S
        while True:
            try:
                await step()
                return
            except (RedisConnectionError, RedisTimeoutError) as exc:
                if time.monotonic() > deadline:
                    raise
                log.warning("starting: Redis cannot be reached, trying again: %s", exc)
                await asyncio.sleep(0.5)

    async def _ensure_groups(self) -> None:
        """Create the consumer groups (again, after Redis lost them in a restart)."""
        for stream in self.streams:
            try:
                await self.redis.xgroup_create(stream, WORKER_GROUP, id="0", mkstream=True)
            except ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

    async def _beat(self) -> None:
        await CLOCK.sync(self.redis)  # (deadlines written by gateways on other hosts)
        key = self.keys.live_workers(self.config.name, self.version)
        hosts = self.keys.worker_hosts(self.config.name, self.version)
        now = CLOCK.now()
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.zadd(key, {self.worker_id: now + 3 * self.settings.heartbeat_s})
            pipe.zremrangebyscore(key, "-inf", now)
            pipe.hset(hosts, self.worker_id, self.host)
            pipe.zrange(key, 0, -1)
            pipe.hkeys(hosts)
            *_, live, advertised = await pipe.execute()
        gone = set(advertised) - set(live)  # workers that died without leaving
        if gone:
            await self.redis.hdel(hosts, *gone)
        if self._lease is not None and not await self._lease.renew():
            self._stopping.set()  # another worker serves the slot now

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.settings.heartbeat_s)
            try:
                await self._beat()
            except RedisError as exc:
                log.warning("heartbeat failed: %s", exc)

    def _reclaimer(self) -> Reclaimer:
        return Reclaimer(
            self.redis,
            self.keys,
            self.settings,
            self.config.name,
            self.version,
            self.worker_id,
            self.streams,
            self._parse,
            self.publisher,
        )

    async def _reclaim_loop(self) -> None:
        reclaimer = self._reclaimer()
        while True:
            await asyncio.sleep(self.settings.reclaim_interval_s)
            if self._stopping.is_set():
                continue
            try:
                self._reclaimed += await reclaimer.reclaim()
            except ResponseError as exc:
                if "NOGROUP" in str(exc):
                    await self._ensure_groups()
                else:
                    log.warning("reclaiming failed: %s", exc)
            except RedisError as exc:
                log.warning("reclaiming failed: %s", exc)

    # -- batch formation -------------------------------------------------------------------

    async def _serve(self, backend: Backend) -> None:
        limit = max(1, self.config.max_batch_size)
        idle: asyncio.Event | ComputeSlots
        if self._concurrency == 1:
            idle = asyncio.Event()
            idle.set()
        else:
            idle = ComputeSlots(self._concurrency)
        carry: list[PendingRequest] = []
        running: set[asyncio.Task[None]] = set()
        while True:
            batch, carry, close = await self._gather(carry, idle)
            if batch:
                computing = not idle.is_set()
                await idle.wait()
                if self._look_again(batch, carry, computing):
                    # Formed while the last batch computed: online requests that arrived
                    # meanwhile go first, or by their deadlines.
                    arrived = await self._read_online(limit)
                    if arrived:
                        carry = arrived + batch + carry
                        continue
                idle.clear()
                close.waited_ns = int((time.monotonic() - close.opened) * 1e9)
                task = asyncio.create_task(self._execute(batch, backend, close, idle))
                running.add(task)
                task.add_done_callback(running.discard)
            elif self._stopping.is_set() or (self.drain and not running and not carry):
                break
        if running:
            await asyncio.gather(*running)

    def _look_again(
        self, batch: list[PendingRequest], carry: list[PendingRequest], computing: bool
    ) -> bool:
        """Whether a batch formed while the last one computed is chosen again from what
        arrived meanwhile: a background batch, always; with deadline order, a batch that
        waited for the compute thread, while this worker holds less than a batch more
        (the rest stays in the stream, for the model's other instances)."""
        if self._stopping.is_set():
            return False
        if batch[0].level == self._background:
            return True
        return computing and self._edf and len(carry) < max(1, self.config.max_batch_size)

    async def _read(
        self, count: int, block_ms: int | None, *, background: bool = True
    ) -> list[PendingRequest]:
        """New requests. The background stream (jobs, batch jobs) is read only with
        ``background``, and then a few entries at a time: before each batch the worker looks
        for online requests again (:meth:`_gather`, :meth:`_serve`), so an online request
        never waits behind more than the batch being computed. Waiting (``block_ms``) is one
        call on every stream, as an idle worker's read is on the path of every request."""
        if not background:
            return await self._read_from(self.streams[:-1], count, block_ms)
        if block_ms is not None:
            return await self._read_from(self.streams, max(1, count // 8), block_ms)
        online = await self._read_from(self.streams[:-1], count, None)
        if online or self._stopping.is_set():
            return online
        return await self._read_from(self.streams, max(1, count // 8), None)

    async def _read_online(self, count: int) -> list[PendingRequest]:
        """Online requests that arrived while background ones were held (no waiting)."""
        return await self._read_from(self.streams[:-1], count, None)

    async def _read_from(
        self, streams: list[str], count: int, block_ms: int | None
    ) -> list[PendingRequest]:
        if self._lease is not None:
            try:
                held = await self._lease.hold_for((block_ms or 0) / 1000 + 0.1)
            except RedisError as exc:
                log.warning("cannot renew the slot's lease: %s", exc)
                await asyncio.sleep(0.2)
                return []
            if not held:
                self._stopping.set()  # another worker serves the slot now
                return []
        try:
            response: StreamRead = await self.redis.xreadgroup(  # type: ignore[assignment]
                WORKER_GROUP,
                self.worker_id,
                dict.fromkeys(streams, ">"),
                count=max(1, count),
                block=block_ms,
            )
        except ResponseError as exc:
            if "NOGROUP" in str(exc):
                log.warning("consumer group missing (Redis restarted?); creating it again")
                with contextlib.suppress(RedisError):
                    await self._ensure_groups()
            else:
                log.warning("reading requests failed: %s", exc)
            await asyncio.sleep(0.2)
            return []
        except RedisError as exc:
            log.warning("reading requests failed: %s", exc)
            await asyncio.sleep(0.5)
            return []
        pending: list[PendingRequest] = []
        rejected: list[Outcome] = []
        arrived = 0
        for stream, entries in response or ():
            name = stream.decode() if isinstance(stream, bytes) else stream
            level = self.streams.index(name)
            arrived += len(entries)
            for entry_id, fields in entries:
                parsed = self._parse(entry_id, fields, name, level)
                if isinstance(parsed, Outcome):
                    rejected.append(parsed)
                elif parsed is not None:
                    pending.append(parsed)
        self._policy.arrivals.add(arrived, time.monotonic())
        if rejected:
            _log_failures(rejected)
            await self.publisher.publish(rejected)
        return pending

    def _parse(
        self, entry_id: bytes, fields: dict[bytes, bytes], stream: str, level: int
    ) -> PendingRequest | Outcome | None:
        try:
            message, payload = decode_request(fields)
        except MalformedEntry as exc:
            log.error("dropping malformed entry %s: %s", entry_id, exc)
            asyncio.get_running_loop().create_task(self._discard(stream, entry_id))
            return None
        request = PendingRequest(entry_id, message, payload, 1, (), stream, level)
        try:
            validate(message, self.config)
            request.items = request_items(message, self.config)
            request.key = shape_key(message, self.config)
        except SluiceError as exc:
            return error_outcome(request, self.version, exc)
        return request

    async def _discard(self, stream: str, entry_id: bytes) -> None:
        with contextlib.suppress(RedisError):
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.xack(stream, WORKER_GROUP, entry_id)
                pipe.xdel(stream, entry_id)
                await pipe.execute()

    def _select(
        self, pending: list[PendingRequest]
    ) -> tuple[list[PendingRequest], list[PendingRequest], bool]:
        """The next batch (highest priority first, then arrival order or, with adaptive
        batching, earliest deadline; all of the first request's shape), the rest, and
        whether the batch is full."""
        if self._edf:
            pending.sort(key=lambda r: (r.level, r.message.deadline_ns or _NO_DEADLINE_NS))
        else:
            pending.sort(key=lambda r: r.level)
        limit = max(1, self.config.max_batch_size)
        key = pending[0].key
        batch: list[PendingRequest] = []
        rest: list[PendingRequest] = []
        items, full = 0, False
        sequences: set[Any] = set()
        for request in pending:
            if self._book is not None:
                # One request of a sequence per batch: the next needs this one's state.
                sequence = request.message.parameters.get("sequence_id")
                if sequence in sequences:
                    rest.append(request)
                    continue
                sequences.add(sequence)
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

    def _take_reclaimed(self) -> list[PendingRequest]:
        taken, self._reclaimed = self._reclaimed, []
        return taken

    async def _gather(
        self, carry: list[PendingRequest], idle: asyncio.Event | ComputeSlots
    ) -> tuple[list[PendingRequest], list[PendingRequest], BatchClose]:
        """The next batch, the requests left for later, and why the batch closed."""
        limit = max(1, self.config.max_batch_size)
        dynamic = self.config.dynamic_batching
        preferred = set(dynamic.preferred_batch_sizes) if dynamic else set()
        policy = self._policy
        first = time.monotonic()
        pending = carry + self._take_reclaimed()
        if not pending:
            if self._stopping.is_set():
                return [], [], BatchClose("stopping", first)
            pending = await self._read(limit, None if self.drain else _IDLE_BLOCK_MS)
            if not pending:
                return [], [], BatchClose("window", first)
            first = time.monotonic()
        elif any(r.level == self._background for r in pending) and not self._stopping.is_set():
            pending += await self._read_online(limit)  # they go first (sorted by level)
        while True:
            batch, rest, full = self._select(pending)
            items = sum(r.items for r in batch)
            now = time.monotonic()
            waited = now - first
            if full:
                return batch, rest, BatchClose("full", first)
            if self._stopping.is_set():
                return batch, rest, BatchClose("stopping", first)
            if idle.is_set():
                reason = "preferred" if items in preferred else policy.close(items, waited, now)
                if reason is not None:
                    return batch, rest, BatchClose(reason, first)
            wait_s = policy.window_s - waited
            if not idle.is_set():
                # The batch cannot go before the compute thread is free: wait for that,
                # then take what arrived meanwhile (no polling while it computes).
                await idle.wait()
                more = await self._read(limit - items, None, background=self.drain)
            elif wait_s >= 0.1:
                more = await self._read(limit - items, math.ceil(wait_s * 1000))
            else:
                # Redis ends a BLOCK shorter than its cron period (100 ms at the default
                # hz 10) only at its next tick: sleep here instead, in slices of 1 ms so a
                # batch that fills early goes early, and read without blocking. The event
                # loop's timers have millisecond resolution, so a shorter wait only yields.
                await asyncio.sleep(0.001 if wait_s >= 0.001 else 0)
                more = await self._read(limit - items, None, background=self.drain)
            more += self._take_reclaimed()
            pending = batch + rest + more
            if not more and self.drain and idle.is_set():
                return batch, rest, BatchClose("window", first)

    # -- execution -------------------------------------------------------------------------

    async def _execute(
        self,
        batch: list[PendingRequest],
        backend: Backend,
        close: BatchClose,
        idle: asyncio.Event | ComputeSlots,
    ) -> None:
        """Compute ``batch``, then publish its answers while the next batch computes: the
        instance is free (``idle``) again once this batch's answers are the next to go, so
        at most one batch's answers are in flight and a Redis round trip is not on the
        path from one batch to the next. (With a concurrent backend, ``idle`` counts free
        slots: this batch gives its slot back at the same point.)"""
        started = time.monotonic()
        policy = self._policy
        turn = False
        try:
            outcomes, timing, items = await self._compute_batch(batch, backend)
            await self._publish_turn.acquire()
            turn = True
        finally:
            busy_s = time.monotonic() - started
            idle.set()
        try:
            if items:
                # What the batch cost: the instance was busy for this long.
                predicted = policy.cost.predict(items) if policy.cost.warm else None
                if predicted is not None and busy_s > 0:
                    close.cost_error = abs(predicted - busy_s) / busy_s
                policy.cost.observe(items, busy_s)
            _log_failures(outcomes)
            await self.publisher.publish(outcomes, timing, items, close)
        finally:
            if turn:
                self._publish_turn.release()

    async def _compute_batch(
        self, batch: list[PendingRequest], backend: Backend
    ) -> tuple[list[Outcome], Timing, int]:
        """Each request's outcome, the batch's timing and the items computed. Requests
        whose deadline passed, or (adaptive batching) cannot be met by the batch's
        expected cost, are answered without computing."""
        now_ns = CLOCK.now_ns()
        policy = self._policy
        cost = policy.cost
        predicted_s = cost.predict(sum(r.items for r in batch)) if cost.warm else 0.0
        doomed_ns = now_ns + int(predicted_s * 1e9) if policy.adaptive else now_ns
        if log.isEnabledFor(logging.DEBUG):
            ids = [r.message.request_id for r in batch]
            log.debug("batch of %d request(s)", len(batch), extra={"request_ids": ids})
        span = self._trace_batch(batch, now_ns) if self.tracing is not None else None
        failure = ""
        outcomes: list[Outcome] = []
        live: list[PendingRequest] = []
        for request in batch:
            deadline = request.message.deadline_ns
            if deadline and deadline < now_ns:
                expired = DeadlineExceeded("the request's deadline passed while it was queued")
                outcomes.append(error_outcome(request, self.version, expired))
            elif deadline and deadline < doomed_ns:
                doomed = DeadlineExceeded(
                    "the request's deadline would pass before its batch computes "
                    f"(about {predicted_s * 1e3:.3g} ms)"
                )
                outcomes.append(error_outcome(request, self.version, doomed))
            else:
                live.append(request)
        if self._book is not None and live:
            live, refused = await self._book.admit(live)
            outcomes += [error_outcome(r, self.version, exc) for r, exc in refused]
        timing = Timing(started_ns=now_ns)
        if live:
            await self.publisher.started(live)
            loop = asyncio.get_running_loop()
            try:
                results = await loop.run_in_executor(
                    self._executor, self._compute, live, backend, timing
                )
                for request, result in zip(live, results, strict=True):
                    if isinstance(result, SluiceError):
                        outcomes.append(error_outcome(request, self.version, result))
                        continue
                    headers, payload = result
                    reply = ReplyMessage(request.message.request_key, self.version, headers)
                    outcomes.append(Outcome(request, reply, payload))
            except Exception as exc:
                error: SluiceError = (
                    exc
                    if isinstance(exc, SluiceError)
                    else InferenceFailed(f"{type(exc).__name__}: {exc}")
                )
                failure = error.message
                outcomes.extend(error_outcome(r, self.version, error) for r in live)
        if span is not None:
            span.end(failure)
        return outcomes, timing, sum(r.items for r in live)

    def _trace_batch(self, batch: list[PendingRequest], started_ns: int) -> BatchSpan:
        """Each request's ``queue_wait`` span, and the batch's ``batch_compute`` span."""
        assert self.tracing is not None
        requests = [(r.message.trace, r.message.request_id, r.message.enqueued_ns) for r in batch]
        return self.tracing.batch(self.config.name, self.version, requests, started_ns)

    def _compute(
        self, batch: list[PendingRequest], backend: Backend, timing: Timing
    ) -> list[tuple[list[TensorHeader], bytes] | SluiceError]:
        """Each request's (output headers, payload), or its own error."""
        t0 = time.perf_counter_ns()
        try:
            inputs = combine(batch, self.config)
        except InvalidInput:
            if len(batch) == 1:
                raise
            return self._each_alone(batch, backend, timing)
        if self.config.decoupled:
            answers = self._compute_decoupled(batch, inputs, backend)
            timing.infer_ns = time.perf_counter_ns() - t0
            return answers
        book = self._book
        wanted = output_names(batch)
        if book is not None:
            try:
                inputs.update(book.inputs(batch))
            except InvalidInput:
                if len(batch) == 1:
                    raise
                return self._each_alone(batch, backend, timing)
            wanted = [*wanted, *book.state_outputs]
        t1 = time.perf_counter_ns()
        failures: dict[int, SluiceError] = {}
        try:
            if self._concurrency == 1:
                outputs = backend.infer(inputs, wanted, request_sizes=[r.items for r in batch])
            else:
                # A concurrent backend (an ensemble) passes each request's deadline and ids
                # on to the requests it makes itself.
                outputs = cast(ConcurrentBackend, backend).infer(
                    inputs,
                    wanted,
                    request_sizes=[r.items for r in batch],
                    contexts=[_context(r.message) for r in batch],
                )
        except RequestsFailed as exc:
            if exc.outputs is None or book is not None:
                return [exc.failures.get(i, exc) for i in range(len(batch))]
            outputs, failures = exc.outputs, dict(exc.failures)
        if book is not None:
            book.update(batch, outputs)
        t2 = time.perf_counter_ns()
        try:
            results = split(batch, outputs, self.config, self._labels)
        except InvalidInput:
            if len(batch) == 1:
                raise
            return self._each_alone(batch, backend, timing)
        t3 = time.perf_counter_ns()
        timing.input_ns, timing.infer_ns, timing.output_ns = t1 - t0, t2 - t1, t3 - t2
        return [failures.get(i, result) for i, result in enumerate(results)]

    def _compute_decoupled(
        self, batch: list[PendingRequest], inputs: dict[str, Any], backend: Backend
    ) -> list[tuple[list[TensorHeader], bytes] | SluiceError]:
        """A decoupled model's batch: each response but a request's final one is published
        as it comes (in order: this thread waits for each); the final ones are returned,
        published and acknowledged as any answer. A request whose final response carries no
        outputs is answered with none (clients see the stream end)."""
        finals: dict[int, tuple[list[TensorHeader], bytes] | SluiceError] = {}

        def emit(index: int, outputs: Any, final: bool) -> None:
            request = batch[index]
            result: tuple[list[TensorHeader], bytes] | SluiceError
            if outputs is None:
                result = ([], b"")
            elif isinstance(outputs, SluiceError):
                result, final = outputs, True
            else:
                try:
                    result = split([request], outputs, self.config, self._labels)[0]
                except SluiceError as exc:
                    result, final = exc, True
            if index in finals:
                return  # the request was answered already
            if final:
                finals[index] = result
                return
            assert not isinstance(result, SluiceError)
            headers, payload = result
            reply = ReplyMessage(request.message.request_key, self.version, headers, final=False)
            partial = self.publisher.partial(request, reply, payload)
            assert self._loop is not None
            asyncio.run_coroutine_threadsafe(partial, self._loop).result()

        stream = getattr(backend, "infer_stream")  # noqa: B009 (checked when the model loaded)
        stream(inputs, output_names(batch), [r.items for r in batch], emit)
        missing = InferenceFailed("the model sent no final response")
        return [finals.get(index, missing) for index in range(len(batch))]

    def _each_alone(
        self, batch: list[PendingRequest], backend: Backend, timing: Timing
    ) -> list[tuple[list[TensorHeader], bytes] | SluiceError]:
        """One request's bad input (a client region gone, shrunk or replaced by a link
        since :func:`validate`) fails that request only: the batch runs request by request."""
        results: list[tuple[list[TensorHeader], bytes] | SluiceError] = []
        for request in batch:
            try:
                results.extend(self._compute([request], backend, timing))
            except SluiceError as exc:
                results.append(exc)
        return results


def _context(message: RequestMessage) -> RequestContext:
    return RequestContext(
        request_id=message.request_id or message.client_id,
        deadline_ns=message.deadline_ns,
        trace=message.trace,
        priority=message.priority,
    )


def _log_ids(message: RequestMessage) -> dict[str, Any]:
    """The ids a request's log lines carry (see :mod:`sluice.core.logs`)."""
    trace_id = message.trace.trace_id if message.trace is not None else None
    return {"request_id": message.request_id or message.client_id or None, "trace_id": trace_id}


def _log_failures(outcomes: list[Outcome]) -> None:
    """One line per failed request, with its ids and the error's text (never its data);
    a deadline that passed in the queue is routine under load, so only INFO."""
    for outcome in outcomes:
        reply = outcome.reply
        if reply.error_kind:
            level = (
                logging.INFO if reply.error_kind == DeadlineExceeded.__name__ else logging.WARNING
            )
            log.log(
                level,
                "request failed: %s: %s",
                reply.error_kind,
                reply.error,
                extra=_log_ids(outcome.request.message),
            )


def install_signal_handlers(worker: Worker) -> None:
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, worker.stop)
