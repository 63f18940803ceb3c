"""Everything a scrape reports, read from Redis in two pipelined round trips.

Per model version: its statistics hash (Triton's counters, the histograms, Sluice's
counters), and per request stream its length, the entries delivered to workers and not yet
answered, and the id of its oldest entry (entries are deleted once answered, so the first
one left is the oldest waiting request). Besides: the Redis server's clock (ages are
measured against it, never against this host's), the reports of the live gateways, and the
gateway counters that belong to no model.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import RedisError

from sluice.core.catalog import UNLOADED
from sluice.core.clock import CLOCK
from sluice.core.keys import WORKER_GROUP, Keys
from sluice.core.on_demand import HostMemory, host_memories
from sluice.core.torchserve.versions import VERSION_KEY
from sluice.gateway.control.catalog_view import CatalogView

ModelVersion = tuple[str, int]


@dataclass
class StreamState:
    priority: int
    """Priority level (1 highest), or 0 for a model without priority levels."""
    length: int = 0
    delivered: int = 0
    """Entries a worker holds (XPENDING): taken, not yet answered."""
    oldest_ms: int | None = None
    """Unix milliseconds of the oldest entry's id, None when the stream is empty."""
    parts: int = 1
    """Streams of the level (its base stream and its tenants' streams), summed here."""

    @property
    def waiting(self) -> int:
        """Entries not yet delivered to any worker (the consumer group's lag)."""
        return max(0, self.length - self.delivered)


@dataclass
class VersionState:
    model: str
    version: int
    counters: dict[str, int] = field(default_factory=dict)
    streams: list[StreamState] = field(default_factory=list)
    live_workers: int = 0
    expected_instances: int = 1
    load_error: bool = False
    listed_as: str = ""
    """Model namespacing: for a copy of a name several repositories hold (``model`` its
    internal name), that name (:attr:`sluice.core.catalog.CatalogEntry.listed_as`)."""
    namespace: str = ""
    """Model namespacing: the repository the model comes from
    (:meth:`sluice.gateway.control.catalog_view.CatalogView.namespace_of`)."""
    torchserve_version: str = ""
    """TorchServe's name for the version (:mod:`sluice.core.torchserve.versions`), as its
    configuration records it; empty where it records none."""


@dataclass
class Snapshot:
    versions: list[VersionState]
    now_ms: int
    gateways: list[dict[str, int]]
    gateway_counters: dict[str, int]
    hosts: list[HostMemory] = field(default_factory=list)
    """The memory budget and use of each host that loads models on demand."""
    custom: dict[bytes, bytes] = field(default_factory=dict)
    """The metrics models define themselves, one report per live worker, as written
    (:mod:`sluice.core.observability.custom_metrics`: decoded where the text is rendered, off the
    loop)."""


async def take(redis: Redis, keys: Keys, view: CatalogView) -> Snapshot:
    versions: list[VersionState] = []
    now = CLOCK.now()
    async with redis.pipeline(transaction=False) as pipe:
        pipe.zrangebyscore(keys.gateways, now, "+inf")
        pipe.hgetall(keys.gateway_counters)
        pipe.hgetall(keys.host_memory)
        pipe.hgetall(keys.custom_metrics)
        pipe.zrange(keys.custom_metrics_expiry, 0, -1, withscores=True)
        for name in sorted(view.models):
            entry = view.models[name]
            if not entry.available:
                continue
            for version in sorted(entry.versions):
                state = VersionState(
                    name, version, listed_as=entry.listed_as, namespace=view.namespace_of(entry)
                )
                if entry.config is not None:
                    state.expected_instances = entry.config.total_instances
                    state.torchserve_version = entry.config.parameters.get(
                        f"{VERSION_KEY}{version}", ""
                    )
                error = view.load_error(name, version)
                if error == UNLOADED:  # (released with a failed load's other versions)
                    state.expected_instances = 0
                state.load_error = error is not None and error != UNLOADED
                pipe.hgetall(keys.stats(name, version))
                # Heartbeats hold their expiry (unix seconds): count those in the future.
                pipe.zcount(keys.live_workers(name, version), now, "+inf")
                streams = view.streams(entry, version)
                for level, base in enumerate(streams, start=1):
                    # A level's tenant streams count in it (:mod:`sluice.core.queue_streams`).
                    level_streams = [base, *view.tenant_streams(name, version, base)]
                    state.streams.append(
                        StreamState(level if len(streams) > 1 else 0, parts=len(level_streams))
                    )
                    for stream in level_streams:
                        pipe.xlen(stream)
                        pipe.xpending(stream, WORKER_GROUP)
                        pipe.xrange(stream, "-", "+", count=1)
                versions.append(state)
        results: list[Any] = await pipe.execute(raise_on_error=False)
    # Redis's clock (entry ids are its milliseconds), as last read; a cluster pipeline
    # cannot carry TIME.
    now_ms = CLOCK.now_ns() // 1_000_000
    live = [_text(member) for member in _list(results[0])]
    hosts = host_memories(results[2], now) if isinstance(results[2], dict) else []
    custom = await _custom_reports(redis, keys, results[3], results[4], now)
    position = 5
    for state in versions:
        state.counters = _counters(results[position])
        live_workers = results[position + 1]
        position += 2
        state.live_workers = live_workers if isinstance(live_workers, int) else 0
        for stream_state in state.streams:
            for _ in range(stream_state.parts):
                length, pending, first = results[position : position + 3]
                position += 3
                stream_state.length += length if isinstance(length, int) else 0
                stream_state.delivered += (
                    int(pending.get("pending", 0)) if isinstance(pending, dict) else 0
                )
                if isinstance(first, list) and first:
                    oldest = int(_text(first[0][0]).split("-", 1)[0])
                    if stream_state.oldest_ms is None or oldest < stream_state.oldest_ms:
                        stream_state.oldest_ms = oldest
    gateways: list[dict[str, int]] = []
    if live:
        async with redis.pipeline(transaction=False) as pipe:
            for gateway_id in live:
                pipe.hgetall(keys.gateway_report(gateway_id))
            reports = await pipe.execute(raise_on_error=False)
        gateways = [_counters(report) for report in reports if report]
    return Snapshot(versions, now_ms, gateways, _counters(results[1]), hosts, custom)


async def _custom_reports(
    redis: Redis, keys: Keys, reports: Any, expiries: Any, now: float
) -> dict[bytes, bytes]:
    """The custom metrics reports whose expiry (the deployment clock's) is still ahead.
    The others are removed: those of workers that died without taking theirs back, and a
    report left with no expiry at all (written back by a worker as a scrape removed it,
    the worker dying before its next beat), which would otherwise be shown for good."""
    reports = reports if isinstance(reports, dict) else {}
    expiries = dict(_list(expiries))
    live = {worker for worker, expires in expiries.items() if expires > now}
    stale_reports = [worker for worker in reports if worker not in live]
    stale_expiries = [worker for worker in expiries if worker not in live]
    if stale_reports or stale_expiries:
        with contextlib.suppress(RedisError):
            async with redis.pipeline(transaction=False) as pipe:
                if stale_reports:
                    pipe.hdel(keys.custom_metrics, *stale_reports)
                if stale_expiries:
                    pipe.zrem(keys.custom_metrics_expiry, *stale_expiries)
                await pipe.execute()
    return {worker: report for worker, report in reports.items() if worker in live}


def _text(value: bytes | str) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


COUNTER_LIMIT = 1 << 63
"""Redis keeps its counters in 64 signed bits: a value beyond is no counter of Sluice's (and
one past a float's range would fail the rendering of the whole scrape)."""


def _counters(value: Any) -> dict[str, int]:
    """The integer fields of a hash; fields that hold anything else are left out, so that a
    malformed value fails no scrape."""
    if not isinstance(value, dict):
        return {}
    counters: dict[str, int] = {}
    for key, raw in value.items():
        try:
            number = int(raw)
        except (TypeError, ValueError):
            continue
        if -COUNTER_LIMIT <= number < COUNTER_LIMIT:
            counters[_text(key)] = number
    return counters
