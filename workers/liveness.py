"""Liveness: a worker's heartbeat, and a sequence worker's hold on its slot.

Each beat renews the worker's place among the model version's live workers (a score three
beats ahead, on the deployment clock) and its advertised host, drops the advertised hosts
of workers that died without leaving, and renews the slot lease. Other workers take over
the entries of a worker whose beats stopped (:mod:`sluice.workers.reclaim`).

The beat also carries the model's custom metrics report
(:mod:`sluice.core.observability.custom_metrics`), with an expiry on the same clock: taken
back when the model no longer has any family, and when the worker leaves; a worker that
dies leaves it to expire three beats on (a gateway's scrape then removes it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.exceptions import RedisError

from sluice.core.clock import CLOCK
from sluice.core.keys import Keys
from sluice.core.observability import custom_metrics
from sluice.core.settings import WorkerSettings
from sluice.workers.slot_lease import SlotLease

log = logging.getLogger(__name__)


class Liveness:
    def __init__(
        self,
        redis: Redis,
        keys: Keys,
        settings: WorkerSettings,
        model: str,
        version: int,
        worker_id: str,
        host: str,
        stopping: asyncio.Event,
    ) -> None:
        """``stopping`` is set once another worker serves this worker's slot."""
        self.redis = redis
        self.keys = keys
        self.settings = settings
        self.model = model
        self.version = version
        self.worker_id = worker_id
        self.host = host
        self.stopping = stopping
        self.lease: SlotLease | None = None
        """A sequence worker's hold on its slot (:mod:`sluice.workers.slot_lease`), once taken."""
        self._measured = False
        self._reported: bytes | None = None
        """The custom metrics report last written (not written again while unchanged)."""
        self._report_held = False
        """Whether Redis may hold a custom metrics report of this worker's (to take back)."""

    async def beat(self) -> None:
        # A cluster pipeline refuses TIME (it names no key): there the clock is measured
        # apart, at each beat.
        timed = not isinstance(self.redis, AsyncRedisCluster)
        if not self._measured or not timed:  # (the first beat's score is on a measured clock)
            await CLOCK.sync(self.redis)
            self._measured = True
        key = self.keys.live_workers(self.model, self.version)
        hosts = self.keys.worker_hosts(self.model, self.version)
        now = CLOCK.now()
        # One round trip: the clock is measured (deadlines written by gateways on other
        # hosts) with the beat itself, its TIME first in the pipeline.
        sent = time.time_ns()
        async with self.redis.pipeline(transaction=False) as pipe:
            if timed:
                pipe.time()
            pipe.zadd(key, {self.worker_id: now + 3 * self.settings.heartbeat_s})
            pipe.zremrangebyscore(key, "-inf", now)
            pipe.hset(hosts, self.worker_id, self.host)
            pipe.zrange(key, 0, -1)
            pipe.hkeys(hosts)
            report = self._custom_report(pipe, now)
            taking_back = report is None and self._report_held
            results = await pipe.execute()
        received = time.time_ns()
        if timed:
            (seconds, micros), *results = results
            CLOCK.observe(sent, int(seconds) * 1_000_000_000 + int(micros) * 1_000, received)
        if report is not None:
            *results, _, held = results
            # (held: what HSET or HEXISTS answered; 0 from HSET is an update, still held)
            self._reported = None if held is False else report
        elif taking_back:  # (the model has no family left)
            results = results[:-2]
            self._reported, self._report_held = None, False
        *_, live, advertised = results
        gone = set(advertised) - set(live)  # workers that died without leaving
        if gone:
            await self.redis.hdel(hosts, *gone)
        if self.lease is not None and not await self.lease.renew():
            self.stopping.set()  # another worker serves the slot now

    def _custom_report(self, pipe: Any, now: float) -> bytes | None:
        """Queue this worker's custom metrics report
        (:mod:`sluice.core.observability.custom_metrics`) on ``pipe``, after its new expiry
        (three beats past ``now``, the deployment clock's: a scrape on another host compares
        it with its own); None when the model has no family, whose report written before is
        then taken back. An unchanged report is not written again: the pipeline then asks
        whether Redis still holds it (after a restart it does not, and the next beat writes
        it). The expiry goes first, so that a scrape never finds the report without it."""
        if not custom_metrics.REGISTRY:
            if self._report_held:
                pipe.hdel(self.keys.custom_metrics, self.worker_id)
                pipe.zrem(self.keys.custom_metrics_expiry, self.worker_id)
            return None
        report = custom_metrics.encode_report(custom_metrics.REGISTRY.snapshot())
        expires = now + 3 * self.settings.heartbeat_s
        pipe.zadd(self.keys.custom_metrics_expiry, {self.worker_id: expires})
        if report == self._reported:
            pipe.hexists(self.keys.custom_metrics, self.worker_id)
        else:
            pipe.hset(self.keys.custom_metrics, self.worker_id, report)
        self._report_held = True
        return report

    async def beat_forever(self) -> None:
        while True:
            await asyncio.sleep(self.settings.heartbeat_s)
            try:
                await self.beat()
            except RedisError as exc:
                log.warning("heartbeat failed: %s", exc)

    async def take_slot(self, slot: int) -> SlotLease | None:
        """Hold this sequence worker's slot, standing by while another worker (another
        host's) serves it; None if asked to stop meanwhile."""
        lease = SlotLease.for_worker(
            self.redis,
            self.keys.sequence_owner(self.model, self.version, slot),
            self.host,
            self.worker_id,
            3 * self.settings.heartbeat_s,
        )
        announced = False
        while not self.stopping.is_set():
            try:
                if await lease.acquire():
                    self.lease = lease
                    return lease
            except RedisError as exc:
                log.warning("cannot take slot %d: %s", slot, exc)
            if not announced:
                log.info("slot %d is served by another worker; standing by", slot)
                announced = True
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stopping.wait(), self.settings.heartbeat_s)
        return None

    async def leave(self) -> None:
        """No longer among the live workers; the slot (if held) is free for another."""
        with contextlib.suppress(RedisError):
            await self.redis.zrem(self.keys.live_workers(self.model, self.version), self.worker_id)
            await self.redis.hdel(self.keys.worker_hosts(self.model, self.version), self.worker_id)
            if self._report_held:
                await self.redis.hdel(self.keys.custom_metrics, self.worker_id)
                await self.redis.zrem(self.keys.custom_metrics_expiry, self.worker_id)
                self._report_held = False
            if self.lease is not None:
                await self.lease.release()

    @property
    def slot_lost(self) -> bool:
        return self.lease is not None and self.lease.lost
