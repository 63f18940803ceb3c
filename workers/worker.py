"""One worker process: one instance of one model version, composed from its parts.

- :mod:`sluice.workers.loading`: the backend, labels and batch policy, warmed up;
- :mod:`sluice.workers.liveness`: the heartbeat, and a sequence worker's slot lease;
- :mod:`sluice.workers.intake`: requests read from the streams, and those of dead workers;
- :mod:`sluice.workers.batcher`: which requests go together, and when a batch closes;
- :mod:`sluice.workers.execution`: computing a batch and publishing its answers
  (:mod:`sluice.workers.decoupled` for models that stream responses);
- :mod:`sluice.workers.lifecycle`: patience with Redis at start, signals.

While one batch computes on the compute thread, the event loop already gathers the next.
:func:`sluice.workers.inprocess.running_worker` runs one in a test's own event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from redis.asyncio import Redis
from redis.exceptions import RedisError

from sluice.core.config import ModelConfig
from sluice.core.errors import SluiceError
from sluice.core.exits import EXIT_LOAD_FAILED, EXIT_SLOT_LOST
from sluice.core.hosts import host_id
from sluice.core.keys import Keys, load_error_field
from sluice.core.placement import Placement
from sluice.core.redis_client.connect import connect_async
from sluice.core.settings import WorkerSettings
from sluice.workers import shm_io
from sluice.workers.batcher import Batcher, DynamicBatcher, SequenceBatcher
from sluice.workers.cancellations import BLOCK_S as CANCEL_BLOCK_S
from sluice.workers.cancellations import CancelWatch
from sluice.workers.decoupled import partial_sender
from sluice.workers.execution import Execution
from sluice.workers.fair_share import FairShare
from sluice.workers.intake import StreamIntake
from sluice.workers.lifecycle import install_signal_handlers, patiently
from sluice.workers.liveness import Liveness
from sluice.workers.loading import LoadedModel, load_model
from sluice.workers.rate_limiter import rate_limiter_for
from sluice.workers.replies import Publisher
from sluice.workers.sequence_book import SequenceBook
from sluice.workers.slots import ComputeGate, ComputeSlots

if TYPE_CHECKING:
    from sluice.core.observability.otel import Tracing

__all__ = ["Worker", "install_signal_handlers"]

log = logging.getLogger(__name__)

MAX_LOAD_ERROR_CHARS = 2000
"""The most of a load's error kept (in Redis, the repository index and every load's
answer): a model's exception may carry any amount of text."""

IDLE_BLOCK_MS = 2000
"""How long one read of an idle worker blocks (a request ends it at once; so does a stop,
which unblocks it: :meth:`Worker.stop`). A sequence worker's read blocks at most 0.5 s, as
it holds its slot's lease meanwhile."""


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
        ``tracing``: record each batch's spans (see :mod:`sluice.core.observability.otel`); None: no
        spans. ``slot``: which instance of the model this is (a sequence model's instance reads the
        requests of the sequences routed to its slot)."""
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
        self.worker_id = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.host = host_id(self.settings.host_id)
        """Advertised with the heartbeat: gateways on this host may send shared memory."""
        shm_io.MAPPINGS.host = self.host
        self._stopping = asyncio.Event()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="compute")
        self._redis: Redis | None = None
        self._client_name = f"sluice-worker-{self.worker_id}"
        """The name of this worker's Redis connections (to find its blocked read)."""
        self._unblocking: set[asyncio.Task[None]] = set()

    def stop(self) -> None:
        """Finish what this worker holds, answer and acknowledge it, then leave :meth:`run`."""
        self._stopping.set()
        if self._redis is not None:
            with contextlib.suppress(RuntimeError):  # (no running loop: nothing is blocked)
                task = asyncio.get_running_loop().create_task(self._unblock_reads())
                self._unblocking.add(task)
                task.add_done_callback(self._unblocking.discard)

    async def _unblock_reads(self) -> None:
        """End this worker's blocked idle read now (it returns empty, as if it had waited
        its time), so that a stop does not wait for it. Best effort: where ``CLIENT LIST``
        is not allowed, the read ends by itself."""
        with contextlib.suppress(RedisError, ValueError, TypeError, KeyError):
            clients = await self.redis.client_list()
            for client in clients if isinstance(clients, list) else ():
                if client.get("name") == self._client_name and "b" in client.get("flags", ""):
                    await self.redis.client_unblock(int(client["id"]))

    @property
    def redis(self) -> Redis:
        assert self._redis is not None
        return self._redis

    async def run(self) -> int:
        """Serve until stopped; the process's exit status (:mod:`sluice.core.exits`)."""
        self._redis = connect_async(
            self.settings.redis_url, socket_timeout=10, client_name=self._client_name
        )
        try:
            return await self._run()
        finally:
            await self._redis.aclose()
            self._executor.shutdown(wait=True)

    def _publisher(self) -> Publisher:
        return Publisher(
            self.redis,
            self.keys,
            self.config.name,
            self.version,
            self.worker_id,
            self.settings.reply_max_len,
            histograms=self.settings.allow_metrics,
        )

    async def _run(self) -> int:
        error_field = load_error_field(self.config.name, self.version)
        publisher = self._publisher()
        book: SequenceBook | None = None
        try:
            limiter = rate_limiter_for(
                self.redis,
                self.keys,
                self.settings,
                self.config,
                self.slot,
                self.placement,
                self.host,
                self.worker_id,
            )
            if self.config.sequence_batching is not None:
                book = SequenceBook(
                    self.config, self.model_path.parent.parent, self.redis, self.keys, self.version
                )
                publisher.checkpoints = book.write_checkpoints
                publisher.published = book.published
            model = await asyncio.get_running_loop().run_in_executor(
                self._executor,
                load_model,
                self.config,
                self.model_path,
                self.placement,
                self.settings.model_config_name,
                self.settings.default_max_batch_size,
            )
        except Exception as exc:
            reason = exc.message if isinstance(exc, SluiceError) else f"{type(exc).__name__}: {exc}"
            if len(reason) > MAX_LOAD_ERROR_CHARS:  # (a model's own text: kept in Redis)
                reason = reason[:MAX_LOAD_ERROR_CHARS] + " ... (cut)"
            left = self.settings.load_retries_left
            log.error(
                "cannot load %s version %d: %s%s",
                self.config.name,
                self.version,
                reason,
                f" ({left} retr{'ies' if left != 1 else 'y'} left)" if left else "",
            )
            # A load on request (explicit model control) reports to its own hash, so that
            # the version still serving is not marked unavailable by its failed successor;
            # one that will be retried does not mark it unavailable either.
            if self.settings.load_errors_key:
                await self.redis.hset(self.settings.load_errors_key, error_field, reason)
            elif not left:
                await self.redis.hset(self.keys.load_errors, error_field, reason)
            return EXIT_LOAD_FAILED
        await patiently(lambda: self.redis.hdel(self.keys.load_errors, error_field))
        if model.concurrency > 1:
            # One compute thread per batch in flight; the loading thread's pool retires.
            loader, self._executor = (
                self._executor,
                ThreadPoolExecutor(model.concurrency, thread_name_prefix="compute"),
            )
            loader.shutdown(wait=False)
        intake = StreamIntake(
            self.redis,
            self.keys,
            self.settings,
            self.config,
            self.version,
            self.worker_id,
            self.streams,
            publisher,
            model.policy.arrivals,
            self._stopping,
        )
        if book is None:
            intake.fair_share = FairShare()
        liveness = Liveness(
            self.redis,
            self.keys,
            self.settings,
            self.config.name,
            self.version,
            self.worker_id,
            self.host,
            self._stopping,
        )
        await patiently(intake.ensure_groups)
        await patiently(liveness.beat)
        background = [asyncio.create_task(liveness.beat_forever(), name="heartbeat")]
        if limiter is not None:
            background.append(asyncio.create_task(limiter.keep_registered(), name="rate-limit"))
        following: asyncio.Task[None] | None = None  # (cancellation notices)
        try:
            if book is not None:
                lease = await liveness.take_slot(self.slot)
                if lease is None:
                    return 0  # stopped while standing by
                intake.lease = publisher.lease = lease
                await intake.take_over_slot()
            background.append(asyncio.create_task(intake.reclaim_forever(), name="reclaim"))
            cancels = CancelWatch(self.redis, self.keys, self.config.name, self._stopping)
            following = asyncio.create_task(cancels.follow(), name="cancellations")
            execution = Execution(
                self.config,
                self.version,
                backend=model.backend,
                publisher=publisher,
                executor=self._executor,
                policy=model.policy,
                labels=model.labels,
                book=book,
                concurrency=model.concurrency,
                tracing=self.tracing,
                send_partial=partial_sender(publisher, asyncio.get_running_loop()),
                cancels=cancels,
                limiter=limiter,
            )
            gate: ComputeGate
            if model.concurrency == 1:
                gate = asyncio.Event()
                gate.set()
            else:
                gate = ComputeSlots(model.concurrency)
            await self._batcher(intake, model, book is not None).serve(execution.execute, gate)
        finally:
            await self._end(background, following)
            if limiter is not None:
                await limiter.settled()
            await liveness.leave()
            model.backend.close()
        return EXIT_SLOT_LOST if liveness.slot_lost else 0

    async def _end(
        self, background: list[asyncio.Task[None]], following: asyncio.Task[None] | None
    ) -> None:
        """End the background tasks. ``following`` (the cancellation notices), which reads
        with a block, ends by itself once stopping is set and its read is unblocked: a
        blocked read cancelled as it is unblocked can leave redis-py waiting for good, and
        this worker would never exit. The others are cancelled."""
        self._stopping.set()
        if following is not None:
            await self._unblock_reads()
            await asyncio.wait([following], timeout=CANCEL_BLOCK_S + 1.0)
            background = [*background, following]
        for task in background:
            task.cancel()
        await asyncio.wait(background, timeout=CANCEL_BLOCK_S + 1.0)

    def _batcher(self, intake: StreamIntake, model: LoadedModel, sequences: bool) -> Batcher:
        limit, background = self.config.max_batch_size, len(self.streams) - 1
        if sequences:
            return SequenceBatcher(
                intake,
                model.policy,
                max_batch_size=limit,
                background_level=background,
                stopping=self._stopping,
                drain=self.drain,
                idle_block_ms=IDLE_BLOCK_MS,
            )
        dynamic = self.config.dynamic_batching
        return DynamicBatcher(
            intake,
            model.policy,
            deadline_order=model.deadline_order,
            max_batch_size=limit,
            background_level=background,
            stopping=self._stopping,
            drain=self.drain,
            preferred_sizes=dynamic.preferred_batch_sizes if dynamic else (),
            idle_block_ms=IDLE_BLOCK_MS,
            fair_share=intake.fair_share,
        )
