"""Stream intake: a worker's requests, read from its model version's streams.

:class:`Intake` is what a batcher needs from the stream side; :class:`StreamIntake` reads
the streams through the consumer group (``XREADGROUP``), parses and checks each entry
(answering a bad one at once), and takes over the entries of dead workers
(:mod:`sluice.workers.reclaim`). Entries are acknowledged with their answers
(:mod:`sluice.workers.replies`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from typing import Protocol

from redis.asyncio import Redis
from redis.exceptions import RedisError, ResponseError

from sluice.core.config import ModelConfig
from sluice.core.errors import SluiceError
from sluice.core.keys import WORKER_GROUP, Keys, base_stream
from sluice.core.queue_streams import WAKE_FIELD, levels_of, with_tenants
from sluice.core.redis_client.types import StreamRead
from sluice.core.settings import WorkerSettings
from sluice.core.wire import MalformedEntry, decode_request
from sluice.workers.adaptive import ArrivalRate
from sluice.workers.fair_share import FairShare, parse_weights
from sluice.workers.reclaim import Reclaimer
from sluice.workers.replies import Outcome, Publisher, error_outcome, log_failures
from sluice.workers.slot_lease import SlotLease
from sluice.workers.tensors import PendingRequest, request_items, shape_key, validate

log = logging.getLogger(__name__)


class Intake(Protocol):
    """Where a batcher's requests come from."""

    async def read(
        self, count: int, block_ms: int | None, *, background: bool = True
    ) -> list[PendingRequest]:
        """Up to ``count`` new requests, waiting up to ``block_ms`` for the first (None: no
        waiting). Background requests only with ``background``."""
        ...

    async def read_online(self, count: int) -> list[PendingRequest]:
        """Online requests that arrived meanwhile (no waiting, no background ones)."""
        ...

    async def read_within(
        self, count: int, wait_s: float, *, background: bool
    ) -> list[PendingRequest]:
        """New requests that arrive within about ``wait_s`` (a short wait may end early)."""
        ...

    def take_reclaimed(self) -> list[PendingRequest]:
        """Requests taken over from dead workers since the last call."""
        ...

    async def top_up(self, count: int, held: dict[str, int]) -> list[PendingRequest]:
        """Online requests that wait (no waiting), up to ``count`` entries from each stream
        of which fewer than ``count`` are held (``held``: stream -> entries held), when the
        version has tenant streams (:mod:`sluice.workers.fair_share`); else none."""
        ...


_BLOCK_MIN_S = 0.1
"""Redis ends a BLOCK shorter than its cron period (100 ms at the default hz 10) only at
its next tick: shorter waits sleep on the event loop instead and read without blocking."""

_SLICE_MIN_S = 0.001
"""The shortest sleep of a short wait: the event loop's timers have millisecond resolution."""

_LEASE_BLOCK_MAX_MS = 500
"""A sequence worker's blocking read holds its slot's lease for as long: it blocks no longer."""

TENANTS_REFRESH_S = 5.0
"""How often a reading worker looks at its version's tenant streams and the tenants' weights
again (a new tenant's first entry wakes it at once: :data:`sluice.core.queue_streams.REGISTER`).
Only on the way to a read: an idle worker's blocking read is what paces it."""


class StreamIntake:
    """A worker's requests from its streams, in priority order: online levels first, the
    background stream (jobs, batch jobs) last. ``streams`` are the levels' base streams (a
    stream's index is its level); each level's tenant streams are read with its base stream
    (:mod:`sluice.core.queue_streams`)."""

    def __init__(
        self,
        redis: Redis,
        keys: Keys,
        settings: WorkerSettings,
        config: ModelConfig,
        version: int,
        worker_id: str,
        streams: list[str],
        publisher: Publisher,
        arrivals: ArrivalRate,
        stopping: asyncio.Event,
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.settings = settings
        self.config = config
        self.version = version
        self.worker_id = worker_id
        self.streams = streams
        self.publisher = publisher
        self.arrivals = arrivals
        self.stopping = stopping
        self.lease: SlotLease | None = None
        """A sequence worker's slot lease: it reads only while it holds its slot."""
        self.fair_share: FairShare | None = None
        """Where the tenants' weights go when they are read (the batcher's)."""
        self._reclaimed: list[PendingRequest] = []
        self._background = len(streams) - 1
        self.all_streams = list(streams)
        """Base and tenant streams, each level's together, as last read from Redis."""
        self.level_of = {stream: level for level, stream in enumerate(streams)}
        self._online = streams[:-1]
        self._tenants_read_at = -math.inf

    def _use_streams(self, members: list[bytes | str]) -> None:
        self.all_streams = with_tenants(self.streams, members)
        self.level_of = levels_of(self.streams, self.all_streams)
        self._online = [s for s in self.all_streams if self.level_of[s] < self._background]

    async def refresh_tenants(self) -> None:
        """Read the version's tenant streams and the tenants' weights again (best effort:
        on a Redis error the streams known so far are kept)."""
        self._tenants_read_at = time.monotonic()
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.smembers(self.keys.tenant_streams(self.config.name, self.version))
                pipe.hgetall(self.keys.tenant_weights)
                members, weights = await pipe.execute()
        except RedisError as exc:
            log.warning("reading the tenant streams failed: %s", exc)
            return
        known = set(self.all_streams)
        self._use_streams(list(members))
        if self.fair_share is not None:
            self.fair_share.weights = parse_weights(weights)
        new = [s for s in self.all_streams if s not in known]
        if new:
            await self._create_groups(new)

    async def ensure_groups(self) -> None:
        """Create the consumer groups (again, after Redis lost them in a restart)."""
        await self._create_groups(self.streams)
        known = set(self.all_streams)
        await self.refresh_tenants()  # (creates the groups of the streams new to it)
        await self._create_groups(
            [s for s in known if s in self.level_of and s not in self.streams]
        )

    async def _create_groups(self, streams: list[str]) -> None:
        for stream in streams:
            try:
                await self.redis.xgroup_create(stream, WORKER_GROUP, id="0", mkstream=True)
            except ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

    # -- reading ---------------------------------------------------------------------------

    async def read(
        self, count: int, block_ms: int | None, *, background: bool = True
    ) -> list[PendingRequest]:
        """New requests. The background stream is read only with ``background``, and then
        a few entries at a time: before each batch the worker looks for online requests
        again (:class:`~sluice.workers.batcher.Batcher`), so an online request never waits
        behind more than the batch being computed. Waiting (``block_ms``) is one call on
        every stream, as an idle worker's read is on the path of every request."""
        await self._refresh_due()
        if not background:
            return await self._read_from(self._online, count, block_ms)
        if block_ms is not None:
            return await self._read_from(self.all_streams, max(1, count // 8), block_ms)
        online = await self._read_from(self._online, count, None)
        if online or self.stopping.is_set():
            return online
        return await self._read_from(self.all_streams, max(1, count // 8), None)

    async def read_online(self, count: int) -> list[PendingRequest]:
        await self._refresh_due()
        return await self._read_from(self._online, count, None)

    async def _refresh_due(self) -> None:
        if time.monotonic() - self._tenants_read_at > TENANTS_REFRESH_S:
            await self.refresh_tenants()

    async def top_up(self, count: int, held: dict[str, int]) -> list[PendingRequest]:
        await self._refresh_due()
        if len(self.all_streams) == len(self.streams):
            return []  # no tenant streams: the batcher's reads are all there is to read
        streams = [s for s in self._online if held.get(s, 0) < count]
        return await self._read_from(streams, count, None) if streams else []

    async def read_within(
        self, count: int, wait_s: float, *, background: bool
    ) -> list[PendingRequest]:
        if wait_s >= _BLOCK_MIN_S:
            return await self.read(count, math.ceil(wait_s * 1000))
        # A short wait sleeps on the event loop, then reads without blocking (the batcher
        # calls again while the batch stays open). Reading more often than requests arrive
        # finds nothing: it sleeps one expected gap between arrivals (at least 1 ms), so a
        # batch that fills early still goes early, and without arrivals the whole wait at
        # once, instead of reading every millisecond for nothing.
        await asyncio.sleep(self.slice_s(wait_s))
        return await self.read(count, None, background=background)

    def slice_s(self, wait_s: float) -> float:
        """How long a short wait sleeps before it reads."""
        if wait_s < _SLICE_MIN_S:
            return 0.0  # only yields
        rate = self.arrivals.per_second(time.monotonic())
        gap_s = 1.0 / rate if rate > 0 else wait_s
        return min(wait_s, max(_SLICE_MIN_S, gap_s))

    def take_reclaimed(self) -> list[PendingRequest]:
        taken, self._reclaimed = self._reclaimed, []
        return taken

    async def _read_from(
        self, streams: list[str], count: int, block_ms: int | None
    ) -> list[PendingRequest]:
        if self.lease is not None:
            if block_ms is not None:
                block_ms = min(block_ms, _LEASE_BLOCK_MAX_MS)
            try:
                held = await self.lease.hold_for((block_ms or 0) / 1000 + 0.1)
            except RedisError as exc:
                log.warning("cannot renew the slot's lease: %s", exc)
                await asyncio.sleep(0.2)
                return []
            if not held:
                self.stopping.set()  # another worker serves the slot now
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
                    await self.ensure_groups()
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
        wake_ups: list[tuple[str, bytes]] = []
        for stream, entries in response or ():
            name = stream.decode() if isinstance(stream, bytes) else stream
            level = self.level_of.get(name)
            if level is None:  # (the streams changed while it read)
                level = self.level_of.get(base_stream(name), self._background)
            arrived += len(entries)
            for entry_id, fields in entries:
                if WAKE_FIELD in fields:
                    # A gateway made a new tenant stream known: read it from now on.
                    wake_ups.append((name, entry_id))
                    arrived -= 1
                    continue
                parsed = self.parse(entry_id, fields, name, level)
                if isinstance(parsed, Outcome):
                    rejected.append(parsed)
                elif parsed is not None:
                    pending.append(parsed)
        self.arrivals.add(arrived, time.monotonic())
        if rejected:
            log_failures(rejected)
            await self.publisher.publish(rejected)
        if wake_ups:
            for name, entry_id in wake_ups:
                await self._discard(name, entry_id)
            await self.refresh_tenants()
        return pending

    def parse(
        self, entry_id: bytes, fields: dict[bytes, bytes], stream: str, level: int
    ) -> PendingRequest | Outcome | None:
        """The entry's request; its error answer if it does not fit the model; None (and
        the entry dropped) if it cannot be decoded."""
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

    # -- taking over dead workers' requests -------------------------------------------------

    def reclaimer(self) -> Reclaimer:
        return Reclaimer(
            self.redis,
            self.keys,
            self.settings,
            self.config.name,
            self.version,
            self.worker_id,
            self.all_streams,
            self.parse,
            self.publisher,
            self.level_of,
        )

    async def take_over_slot(self) -> None:
        """What this sequence slot's previous worker held goes first, in order (it is gone:
        one worker per slot), so each sequence goes on where its checkpoint left it."""
        self._reclaimed += await self.reclaimer().take_over(self.streams[0], 0)

    async def reclaim_forever(self) -> None:
        """Every ``reclaim_interval_s``, take over what dead (or stuck) workers held."""
        reclaimer = self.reclaimer()
        while True:
            await asyncio.sleep(self.settings.reclaim_interval_s)
            if self.stopping.is_set():
                continue
            reclaimer.streams, reclaimer.levels = self.all_streams, self.level_of
            try:
                self._reclaimed += await reclaimer.reclaim()
            except ResponseError as exc:
                if "NOGROUP" in str(exc):
                    await self.ensure_groups()
                else:
                    log.warning("reclaiming failed: %s", exc)
            except RedisError as exc:
                log.warning("reclaiming failed: %s", exc)
