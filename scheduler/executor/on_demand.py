"""On-demand models in the executor: loaded when requests wait, the least used evicted when
others need the memory.

Every tick (each second idle, every 0.1 s while something loads, and at once when a gateway
queues a request for a version no worker serves), :class:`OnDemand` looks at each on-demand
model version of this host in one pipelined round trip: its queued entries, its oldest one,
its live workers anywhere, and its answered count. Then:

- **Load** a version with requests waiting that no live worker serves, here or elsewhere,
  when this host takes its lock (one host loads it; a host that would have to evict first
  leaves it a moment to a host with room). Before it starts the workers, the memory the
  version will hold must fit the budget (``SLUICE_MEMORY_BUDGET``, per GPU
  ``SLUICE_GPU_MEMORY_BUDGET``): what it held when last measured (on any host), else its
  files plus what an empty worker of this host holds. Where it does not fit, the versions
  least used in the last minute are evicted first, the least recently used of equals first
  (their workers get SIGTERM and answer what they hold), but never one with requests queued
  or being computed, one pinned (it is not on demand), one still loading, one loaded less
  than ``SLUICE_MIN_RESIDENCY_S`` ago (thrash protection), or, until the version that needs
  the room has waited ``PATIENCE_S``, one used more in the last minute than it (so it is
  never starved); and the new workers start once the evicted ones have exited (one that
  has not within ``SLUICE_WORKER_STOP_GRACE_S`` is killed by the supervisor; what it holds
  counts until it is gone, :mod:`.leaving`). What they free is kept for the version they
  were evicted for, while the versions that waited less make room of their own at the same
  tick. Until there is room the requests wait in their stream, within their timeouts. While
  loads keep having to evict, room for the next one is kept ahead of demand
  (:meth:`OnDemand._keep_spare`).
- **Measure** what each worker of this host holds (:mod:`.process_memory`), keep the largest
  seen per version, and share it in ``Keys.model_memory``.
- **Scale** a loaded version to the instance count the controller's autoscaler wants for it
  (``Keys.desired_instances``, from the model's ``sluice.max_instances`` policy): more
  workers only into room that is free now, once no version waits for room here (and, while
  cold starts have had to evict, only beyond the room kept for the next one); fewer down to
  one (unloading it is eviction's business).
- **Refuse** a version larger than the whole budget (by its files before it loads, by its
  measure after), or one that failed to load (the model's loading failed, its worker
  kept dying while loading it, :data:`MAX_LOAD_EXITS`, or its workers were not ready within
  ``SLUICE_ON_DEMAND_LOAD_TIMEOUT_S``: they are killed): its queued requests are answered
  503 with the reason, and the gateways refuse new ones with it (a load error of that
  version).
- **Report** its states (``LOADING``, ``READY``) and its memory to the gateways (expiring:
  a host that died stops counting), the cold starts and evictions to the version's statistics.

The requests are never at risk: they wait in Redis until a worker answers, whichever host
loads it, whatever is evicted, whoever leads, and a worker killed while it loads is started
again by the supervisor with the requests still queued (until it has died
:data:`MAX_LOAD_EXITS` times: then they are answered).
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import orjson
from redis import Redis

from sluice.core import jobs
from sluice.core.clock import CLOCK
from sluice.core.errors import Unavailable, error_kind
from sluice.core.keys import WORKER_GROUP, Keys, load_error_field
from sluice.core.memory_budget import HOST, format_size
from sluice.core.observability import histograms as hist
from sluice.core.observability import statistics as st
from sluice.core.on_demand import (
    LOADING,
    READY,
    STATE_TTL_S,
    HostMemory,
    encode_state,
    eviction_field,
    host_memories,
    state_field,
)
from sluice.core.placement import threads_per_instance
from sluice.core.queue_streams import base_streams, tenant_members_sync, with_tenants
from sluice.core.repository import RepositoryModel
from sluice.core.wire import MalformedEntry, ReplyMessage, decode_request, encode_reply
from sluice.scheduler.executor.fork_server import ForkServer
from sluice.scheduler.executor.instances import InstanceSpec
from sluice.scheduler.executor.leaving import footprint
from sluice.scheduler.executor.model_control import announced
from sluice.scheduler.executor.process_memory import GpuMemory, host_bytes
from sluice.scheduler.executor.supervisor import Child, ChildSpec, Supervisor

log = logging.getLogger("sluice.up")

Version = tuple[str, int]
Footprint = dict[str, int]
"""Bytes held, by device (``host``, ``gpu0`` ...)."""
VersionSpecs = Callable[[RepositoryModel, int], list[ChildSpec]]
"""The worker processes of one version of a model."""

DEFAULT_WORKER_BYTES = 150 << 20
"""What an empty worker is assumed to hold before this host has measured one."""
ROOM_ELSEWHERE_S = 0.5
"""How long a host that must evict to load a version leaves it to a host with room."""
LOCK_S = 10
"""How long a host's claim to a version (loading it, or holding it loaded) lasts unless the
host renews it: it does at every tick, so a host that died frees its versions within it."""
REFUSED_REPLY_MAX_LEN = 100_000
MAX_SCALED_INSTANCES = 256
"""The most instances an autoscaled version is given here (the autoscaling policy's own
bound: a count beyond it in Redis is not the controller's)."""
USE_WINDOW_S = 60.0
"""How far back a version's uses count when it is weighed against one that needs room."""
MAX_LOAD_EXITS = 3
"""A version whose worker has exited this many times while it loads (not counting the
model's own load failures, which ``--model-load-retry-count`` governs) is refused: a worker
killed once is started again and the requests wait for it, but one that keeps dying
(crashing in the model's loading, killed by the kernel for its memory) would keep them
waiting until their timeouts, load after load."""
PATIENCE_S = 2.0
"""How long a version waiting for room spares the versions used more than it lately: after
that, any candidate may go for it, the least used first. (A bound, not a ramp: a model
asked for once behind one asked for a hundred times a minute, with a budget that holds
one, would otherwise wait minutes.)"""


@dataclass
class Resident:
    """A version with workers on this host."""

    model: RepositoryModel
    version: int
    children: list[Child]
    started: float
    """When its workers were started (monotonic)."""
    oldest_ms: int | None
    """Arrival (Redis ms) of the oldest request waiting when the load began."""
    ready_at: float | None = None
    last_used: float = 0.0
    answered: int = -1
    footprint: Footprint = field(default_factory=dict)
    """The most it held, measured, per device (all its workers)."""
    configured: int = 0
    """Its workers as configured (0: as many as it has), however the autoscaler scales it."""

    @property
    def key(self) -> Version:
        return (self.model.name, self.version)


@dataclass
class _Look:
    """What Redis says of one on-demand version at this tick."""

    queued: int = 0
    oldest_ms: int | None = None
    live_workers: int = 0
    answered: int = 0


@dataclass
class _Room:
    """The budget left at one tick, by device: ``now`` (what the residents and the leaving
    workers leave) and ``later`` (once the leaving ones have exited), less what the versions
    placed so far at this tick take or wait for. A device without a budget has no limit."""

    now: Footprint
    later: Footprint

    def fits_now(self, need: Footprint) -> bool:
        return all(self.now.get(d, 1 << 62) >= s for d, s in need.items()) and self.fits_later(need)

    def fits_later(self, need: Footprint) -> bool:
        return all(self.later.get(d, 1 << 62) >= s for d, s in need.items())

    def short_later(self, need: Footprint) -> Footprint:
        return {d: s - self.later.get(d, 1 << 62) for d, s in need.items()}

    def leaving(self, footprint: Footprint) -> None:
        for device, size in footprint.items():
            if device in self.later:
                self.later[device] += size

    def take(self, need: Footprint) -> None:
        """A version starts loading now."""
        for device, size in need.items():
            for free in (self.now, self.later):
                if device in free:
                    free[device] -= size

    def wait_for(self, need: Footprint) -> None:
        """A version waits for leaving workers to exit: what they free is its, not that of
        the versions placed after it (which may still start in what is free now)."""
        for device, size in need.items():
            if device in self.later:
                self.later[device] -= size


@dataclass
class OnDemand:
    client: Redis
    keys: Keys
    supervisor: Supervisor
    host: str
    """This host's id (:mod:`sluice.core.hosts`)."""
    models: dict[str, RepositoryModel]
    """The on-demand models of the repository, by name."""
    specs: VersionSpecs
    budget: Footprint
    """Bytes this host's on-demand models may hold together, by device; a device not named
    has no limit. (Pinned models and the fork server are outside it: an operator gives
    the on-demand models what the pinned ones leave.)"""
    min_residency_s: float
    instance_spec: InstanceSpec = field(kw_only=True)
    """One more worker of a version, with its compute threads (autoscaling)."""
    load_timeout_s: float = field(kw_only=True)
    """How long a version's workers have, from their start, to be ready: past it the load
    is abandoned, its workers killed and the version refused
    (``SLUICE_ON_DEMAND_LOAD_TIMEOUT_S``)."""
    gpu: GpuMemory | None = None
    forks: ForkServer | None = None
    """Forks the workers of the versions loaded, its imports done (:mod:`.fork_server`)."""
    residents: dict[Version, Resident] = field(default_factory=dict)
    refused: dict[Version, str] = field(default_factory=dict)
    _leaving: list[Child] = field(default_factory=list)
    """Workers of evicted versions that have not exited yet: their memory is not free yet
    (the supervisor kills one still running after the stop grace, :mod:`.leaving`)."""
    _gpu_held: dict[int, Footprint] = field(default_factory=dict)
    """GPU memory by worker pid at this tick (with a GPU budget)."""
    _wanted_since: dict[Version, float] = field(default_factory=dict)
    _measured: dict[Version, Footprint] = field(default_factory=dict)
    """Every version's footprint as last shared in Redis (per instance set)."""
    _tenants: dict[Version, list[str]] = field(default_factory=dict)
    _answered: dict[Version, deque[tuple[float, int]]] = field(default_factory=dict)
    """Each version's answered count at the ticks of the last ``USE_WINDOW_S``."""
    _queued: dict[Version, int] = field(default_factory=dict)
    """Entries queued for each version at this tick: a version with any is never evicted."""
    _pressure: tuple[float, int] | None = None
    """When a version last had to evict to load here, and its uses then (answered, plus
    one): while such loads come, :meth:`_keep_spare` frees room ahead of the next one."""
    _desired: dict[str, int] = field(default_factory=dict)
    """The autoscaler's wanted instance counts (``model:version`` -> count) at this tick."""
    _worker_baseline: int = 0
    """What the smallest worker of this host held beyond its model files (0: none seen)."""

    _last_wake: bytes = b""
    """The newest entry of ``Keys.demand_requests`` seen."""
    _woken_until: float = 0.0
    """A gateway asked for a version lately: its request may land in the stream just after
    the wake-up, so look again soon."""

    @property
    def busy(self) -> bool:
        """Something loads, leaves, waits for room, or was asked for: tick often."""
        return bool(
            self._wanted_since
            or self._leaving
            or time.monotonic() < self._woken_until
            or any(r.ready_at is None for r in self.residents.values())
        )

    def versions(self) -> list[Version]:
        return [(m.name, v) for m in self.models.values() for v in m.versions if m.usable]

    def tick(self) -> None:
        now = time.monotonic()
        self._leaving = [c for c in self._leaving if c.running]
        looks = self._look()
        self._queued = {key: look.queued for key, look in looks.items()}
        for key, look in looks.items():
            seen = self._answered.setdefault(key, deque())
            if len(seen) < 2 or now - seen[-2][0] >= 1.0:
                seen.append((now, look.answered))
            else:  # (a sample a second is enough)
                seen[-1] = (now, look.answered)
            while len(seen) > 1 and now - seen[0][0] > USE_WINDOW_S:
                seen.popleft()
        self._measure()
        for resident in list(self.residents.values()):
            self._follow(resident, looks[resident.key], now)
        wanted = sorted(
            (
                (look.oldest_ms or 0, key)
                for key, look in looks.items()
                if look.queued
                and key not in self.residents
                and (look.live_workers == 0 or key in self.refused)
            ),
        )
        for key in list(self._wanted_since):
            if key not in {k for _, k in wanted}:
                del self._wanted_since[key]
        room = self._room()
        for _, key in wanted:  # the longest waiting first: the room goes to it
            if key in self.refused:
                self._answer_refused(key)
            else:
                self._place(key, looks[key], now, room)
        self._keep_spare(room, now)
        self._scale(room, now)
        if self.forks is not None:
            self.forks.ensure()  # (a new one after it died: its workers died with it)
        self._report()

    # -- looking -------------------------------------------------------------------------

    def _look(self) -> dict[Version, _Look]:
        versions = self.versions()
        CLOCK.sync_blocking(self.client)
        now = CLOCK.now()
        order: list[tuple[Version, int]] = []
        with self.client.pipeline(transaction=False) as pipe:
            for name, version in versions:
                model = self.models[name]
                assert model.config is not None
                dynamic = model.config.dynamic_batching
                bases = base_streams(
                    self.keys, name, version, dynamic.priority_levels if dynamic else 0
                )
                streams = with_tenants(bases, self._tenants.get((name, version), ()))
                for stream in streams:
                    pipe.xlen(stream)
                    pipe.xrange(stream, "-", "+", count=1)
                pipe.zcount(self.keys.live_workers(name, version), now, "+inf")
                pipe.hmget(
                    self.keys.stats(name, version),
                    [st.count_field("success"), st.count_field("fail")],
                )
                pipe.smembers(self.keys.tenant_streams(name, version))
                order.append(((name, version), len(streams)))
            pipe.hgetall(self.keys.desired_instances)
            pipe.xrevrange(self.keys.demand_requests, count=1)
            results: list[Any] = pipe.execute()
        newest = results.pop()
        self._desired = {
            k.decode(): int(v) for k, v in (results.pop() or {}).items() if v.isdigit()
        }
        if newest and newest[0][0] != self._last_wake:
            self._last_wake = newest[0][0]
            self._woken_until = time.monotonic() + 1.0
        looks: dict[Version, _Look] = {}
        position = 0
        for key, stream_count in order:
            look = _Look()
            for _ in range(stream_count):
                length, first = results[position : position + 2]
                position += 2
                look.queued += int(length or 0)
                if first:
                    arrived = int(first[0][0].decode().split("-", 1)[0])
                    look.oldest_ms = (
                        arrived if look.oldest_ms is None else min(look.oldest_ms, arrived)
                    )
            live, counts, tenants = results[position : position + 3]
            position += 3
            look.live_workers = int(live or 0)
            look.answered = sum(int(c) for c in counts if c is not None)
            self._tenants[key] = sorted(t.decode() if isinstance(t, bytes) else t for t in tenants)
            looks[key] = look
        return looks

    def _measure(self) -> None:
        gpu = self._gpu_held = self.gpu.by_process() if self.gpu is not None else {}
        for resident in self.residents.values():
            held: Footprint = {}
            for child in resident.children:
                if child.process is None:
                    continue
                pid = child.process.pid
                held[HOST] = held.get(HOST, 0) + host_bytes(pid)
                for device, size in gpu.get(pid, {}).items():
                    held[device] = held.get(device, 0) + size
            if resident.ready_at is None:
                continue  # still loading: not its size yet
            grown = {d: max(s, resident.footprint.get(d, 0)) for d, s in held.items()}
            if grown != resident.footprint:
                resident.footprint = grown
                self._share(resident)

    def _share(self, resident: Resident) -> None:
        configured = self._configured(resident)
        self._measured[resident.key] = configured
        self.client.hset(
            self.keys.model_memory,
            f"{resident.model.name}:{resident.version}",
            orjson.dumps(configured),
        )
        files = _files_bytes(resident.model.path / str(resident.version))
        per_worker = resident.footprint.get(HOST, 0) // max(1, len(resident.children))
        beyond = max(0, per_worker - files)
        if beyond and (not self._worker_baseline or beyond < self._worker_baseline):
            self._worker_baseline = beyond

    # -- residents -----------------------------------------------------------------------

    def _follow(self, resident: Resident, look: _Look, now: float) -> None:
        if look.queued or look.answered != resident.answered:
            resident.last_used = now
            resident.answered = look.answered
        name, version = resident.key
        if resident.ready_at is None:
            exits = max((_crashes(c) for c in resident.children), default=0)
            if any(c.failed for c in resident.children) or exits >= MAX_LOAD_EXITS:
                reason = self._load_error(resident) or (
                    f"its worker exited {exits} times while loading it"
                    if exits >= MAX_LOAD_EXITS
                    else "its worker could not load it"
                )
                self._drop(resident, reason)
                return
            if announced(self.client, self.keys, name, (version,), resident.children):
                resident.ready_at = resident.last_used = now
                self._cold_start(resident)
            elif now - resident.started >= self.load_timeout_s:
                reason = (
                    f"its workers were not ready within {self.load_timeout_s:g} s of their "
                    "start (SLUICE_ON_DEMAND_LOAD_TIMEOUT_S); the load was abandoned"
                )
                # No grace: stuck in the model's loading, a worker does not end on SIGTERM.
                self._drop(resident, reason, grace_s=0.0)
            return
        over = self._over_budget(self._configured(resident))
        if over:
            self._drop(resident, over)

    def _cold_start(self, resident: Resident) -> None:
        name, version = resident.key
        started_s = took_s = time.monotonic() - resident.started
        if resident.oldest_ms is not None:
            took_s = max(took_s, CLOCK.now_ns() / 1e9 - resident.oldest_ms / 1000)
        counters: dict[str, int] = {}
        hist.COLD_START.observe(counters, int(took_s * 1e9))
        with self.client.pipeline(transaction=False) as pipe:
            for counter, amount in counters.items():
                pipe.hincrby(self.keys.stats(name, version), counter, amount)
            pipe.execute()
        log.info(
            "'%s' version %d loaded on demand in %.2f s (its workers started in %.2f s)",
            name,
            version,
            took_s,
            started_s,
        )

    def _load_error(self, resident: Resident) -> str | None:
        reason = self.client.hget(self.keys.load_errors, load_error_field(*resident.key))
        return cast(bytes, reason).decode() if reason else None

    def _drop(self, resident: Resident, reason: str, grace_s: float | None = None) -> None:
        """Refuse the version for good: it cannot load (in time), or it does not fit the
        budget. Its workers are killed after ``grace_s`` (by default the stop grace,
        :meth:`.Supervisor.retire`)."""
        self._evict(resident, "refused", grace_s=grace_s)
        self._refuse(resident.key, reason)

    def _refuse(self, key: Version, reason: str) -> None:
        """The gateways refuse the version's requests with ``reason`` from now on, and the
        ones already waiting are answered with it."""
        log.error("'%s' version %d is refused: %s", *key, reason)
        self.refused[key] = reason
        self.client.hset(self.keys.load_errors, load_error_field(*key), reason)
        self._answer_refused(key)

    def _evict(
        self, resident: Resident, reason: str, ahead: bool = False, grace_s: float | None = None
    ) -> None:
        self.residents.pop(resident.key, None)
        self.supervisor.retire(resident.children, grace_s)
        self._leaving += [c for c in resident.children if c.running]
        self.client.hincrby(self.keys.stats(*resident.key), eviction_field(reason), 1)
        self.client.delete(self.keys.on_demand_lock(*resident.key))
        if reason == "budget":
            log.info(
                "'%s' version %d unloaded to make room (%s, %s)",
                *resident.key,
                "least used lately, ahead of demand" if ahead else "least used lately",
                format_size(resident.footprint.get(HOST, 0)),
            )

    # -- placing -------------------------------------------------------------------------

    def _place(self, key: Version, look: _Look, now: float, room: _Room) -> None:
        """Start loading the version where it fits, else make room for it (evicting), and
        take its share of ``room``: the versions placed after it at this tick (they waited
        less) do not take what it is waiting for, but make room of their own meanwhile, so
        that several loads hand over at once."""
        name, version = key
        model = self.models[name]
        need = self._estimate(model, version)
        too_big = self._over_budget(
            self._measured.get(key) or {HOST: _files_bytes(model.path / str(version))}
        )
        if too_big:
            self._refuse(key, too_big)
            return
        since = self._wanted_since.setdefault(key, now)
        if (
            not room.fits_now(need)
            and self._room_elsewhere(need)
            and now - since < ROOM_ELSEWHERE_S
        ):
            return  # a host with room may take it
        lock = self.keys.on_demand_lock(name, version)
        taken = self.client.set(lock, self.host, nx=True, ex=LOCK_S)
        if not taken and self.client.get(lock) != self.host.encode():
            return  # another host loads it
        if not room.fits_later(need):
            victims = self._victims(room.short_later(need), now, self._demand(key, now - since))
            if not victims:
                if not self._leaving:
                    self.client.delete(lock)  # nothing frees up here: another host may load it
                return  # it waits for a candidate; one asked for more may find one
            for resident in victims:
                self._evict(resident, "budget")
                room.leaving(resident.footprint)
            self._pressure = (now, self._uses(key, queued=False) + 1)
        if not room.fits_now(need):
            room.wait_for(need)
            return  # it starts once the evicted workers are gone; its share is kept for it
        room.take(need)
        children = self._start(self.specs(model, version))
        self.residents[key] = Resident(
            model, version, children, now, look.oldest_ms, last_used=now, configured=len(children)
        )
        self._wanted_since.pop(key, None)
        log.info(
            "loading '%s' version %d on demand (%d worker(s), about %s)",
            name,
            version,
            len(children),
            format_size(need.get(HOST, 0)),
        )

    def _keep_spare(self, room: _Room, now: float) -> None:
        """Keep room for the next cold start while cold starts have had to evict (in the last
        ``USE_WINDOW_S``): when what is left of the budget would not hold the largest
        resident, evict ahead of demand what the last such load could have evicted without
        waiting (used no more than it had been, past its minimum residency, nothing
        queued), least used first. A model of the long tail is then unloaded once it has
        answered instead of when the next one arrives, and that one finds room instead of
        waiting for an eviction. Without such loads nothing is evicted ahead: a budget that
        holds what is asked for keeps it all."""
        if self._pressure is None or now - self._pressure[0] > USE_WINDOW_S:
            return
        short = room.short_later(self._spare())
        if not any(size > 0 for size in short.values()):
            return
        for resident in self._victims(short, now, demand=self._pressure[1]):
            self._evict(resident, "budget", ahead=True)
            room.leaving(resident.footprint)

    # -- autoscaling ---------------------------------------------------------------------

    def _scale(self, room: _Room, now: float) -> None:
        """Match each loaded version's workers to the autoscaler's wanted count (see the
        module's docstring)."""
        for resident in list(self.residents.values()):
            wanted = self._desired.get(f"{resident.model.name}:{resident.version}")
            if wanted is None or resident.ready_at is None:
                continue
            running = [c for c in resident.children if not c.retiring]
            wanted = min(max(1, wanted), MAX_SCALED_INSTANCES)
            if wanted < len(running):
                self._scale_down(resident, running, wanted)
            elif wanted > len(running) and not self._wanted_since:
                self._scale_up(resident, len(running), wanted, room, now)

    def _scale_down(self, resident: Resident, running: list[Child], wanted: int) -> None:
        leaving = running[wanted:]
        self.supervisor.retire(leaving)
        for child in leaving:
            resident.children.remove(child)
        self._leaving += [c for c in leaving if c.running]
        resident.footprint = {d: s * wanted // len(running) for d, s in resident.footprint.items()}
        log.info(
            "'%s' version %d: %d -> %d instances (autoscaling)",
            *resident.key,
            len(running),
            wanted,
        )

    def _scale_up(
        self, resident: Resident, count: int, wanted: int, room: _Room, now: float
    ) -> None:
        """As many more workers, up to ``wanted``, as fit in the room free now (beyond the
        room kept for the next cold start while cold starts have had to evict)."""
        held = self._held(resident)
        per = {d: s // max(1, count) for d, s in held.items()}
        kept = self._spare() if self._pressure and now - self._pressure[0] <= USE_WINDOW_S else {}
        more = wanted - count
        while more and not room.fits_now(
            {d: per.get(d, 0) * more + kept.get(d, 0) for d in per.keys() | kept.keys()}
        ):
            more -= 1
        if not more:
            return
        extra = {d: size * more for d, size in per.items()}
        room.take(extra)
        # The new workers get the cores divided among the instances, as other scale-ups.
        threads = threads_per_instance(count + more)
        spec = self.instance_spec(resident.model, resident.version, threads)
        resident.children += self._start([spec] * more)
        resident.footprint = {d: s + extra.get(d, 0) for d, s in held.items()}
        log.info(
            "'%s' version %d: %d -> %d instances (autoscaling%s)",
            *resident.key,
            count,
            count + more,
            f"; {wanted} wanted, the budget holds no more now" if count + more < wanted else "",
        )

    def _held(self, resident: Resident) -> Footprint:
        """What the version's workers hold: measured, else estimated."""
        return resident.footprint or self._estimate(resident.model, resident.version)

    def _configured(self, resident: Resident) -> Footprint:
        """What the version holds with its configured instance count (the measure shared
        for its next load, and weighed against the whole budget), however it is scaled."""
        workers = max(1, len(resident.children))
        configured = resident.configured or workers
        return {d: s * configured // workers for d, s in resident.footprint.items()}

    def _spare(self) -> Footprint:
        """The room :meth:`_keep_spare` keeps for the next cold start: the largest resident."""
        return {
            device: max((r.footprint.get(device, 0) for r in self.residents.values()), default=0)
            for device in self.budget
        }

    def _start(self, specs: list[ChildSpec]) -> list[Child]:
        """The workers of ``specs``: forked by the fork server where it runs."""
        children: list[Child] = []
        for spec in specs:
            forked = self.supervisor.prepared(spec)
            process = self.forks.spawn(forked) if self.forks is not None else None
            if process is not None:
                children.append(self.supervisor.adopt(spec, process))
            else:
                children += self.supervisor.add([spec])
        return children

    def _estimate(self, model: RepositoryModel, version: int) -> Footprint:
        measured = self._measured.get((model.name, version))
        if measured is None:
            raw = self.client.hget(self.keys.model_memory, f"{model.name}:{version}")
            if raw:
                try:
                    measured = {str(k): int(v) for k, v in orjson.loads(raw).items()}
                    self._measured[(model.name, version)] = measured
                except (orjson.JSONDecodeError, AttributeError, TypeError, ValueError):
                    measured = None
        if measured:
            return measured
        workers = len(self.specs(model, version))
        files = _files_bytes(model.path / str(version))
        guess = workers * (files + (self._worker_baseline or DEFAULT_WORKER_BYTES))
        # A guess larger than the whole budget is tried alone (the measure then decides).
        return {HOST: min(guess, self.budget.get(HOST, guess))}

    def _resident_bytes(self) -> Footprint:
        used: Footprint = {}
        for resident in self.residents.values():
            size = resident.footprint or self._estimate(resident.model, resident.version)
            for device, held in size.items():
                used[device] = used.get(device, 0) + held
        return used

    def _used(self) -> Footprint:
        used = self._resident_bytes()
        for device, held in self._leaving_footprint().items():
            used[device] = used.get(device, 0) + held
        return used

    def _room(self) -> _Room:
        residents, leaving = self._resident_bytes(), self._leaving_footprint()
        return _Room(
            now={d: b - residents.get(d, 0) - leaving.get(d, 0) for d, b in self.budget.items()},
            later={d: b - residents.get(d, 0) for d, b in self.budget.items()},
        )

    def _leaving_footprint(self) -> Footprint:
        return footprint(self._leaving, self._gpu_held)

    def _uses(self, key: Version, queued: bool = True) -> int:
        """Requests of the version answered in the last ``USE_WINDOW_S``, and (``queued``)
        those queued now."""
        seen = self._answered.get(key)
        answered = seen[-1][1] - seen[0][1] if seen else 0
        return max(0, answered) + (self._queued.get(key, 0) if queued else 0)

    def _demand(self, key: Version, waited_s: float) -> float:
        """Up to the uses of which residents may go to make room for ``key``: its own
        (answered lately and queued), and any once it has waited ``PATIENCE_S``."""
        return math.inf if waited_s >= PATIENCE_S else self._uses(key)

    def _victims(self, short: Footprint, now: float, demand: float = math.inf) -> list[Resident]:
        """The residents to evict so that ``short`` bytes free up: the least used in the last
        ``USE_WINDOW_S`` first, the least recently used of equals first; none when even
        evicting every candidate would not do (the request waits for a candidate: one busy
        now, or too young).

        A candidate is also used no more than ``demand`` (:meth:`_demand`): a model asked for
        once does not push out one asked for every second, unless it has waited. Least used
        before least recently used: a model asked for every few seconds stays while the tail
        of models asked for once a minute takes turns in the rest of the budget (by recency
        alone, the hot model idle for a few seconds would go before the tail model that was
        just answered)."""
        missing = {d: s for d, s in short.items() if s > 0}
        if not missing:
            return []
        candidates = sorted(
            (
                r
                for r in self.residents.values()
                if r.ready_at is not None
                and now - r.ready_at >= self.min_residency_s
                and not self._queued.get(r.key)
                and self._uses(r.key) <= demand
            ),
            key=lambda r: (self._uses(r.key), r.last_used),
        )
        chosen: list[Resident] = []
        for resident in candidates:
            if not missing:
                break
            if not any(resident.footprint.get(d, 0) for d in missing):
                continue
            chosen.append(resident)
            for device in list(missing):
                missing[device] -= resident.footprint.get(device, 0)
                if missing[device] <= 0:
                    del missing[device]
        return chosen if not missing else []

    def _over_budget(self, footprint: Footprint) -> str | None:
        for device, size in footprint.items():
            budget = self.budget.get(device)
            if budget is not None and size > budget:
                setting = "SLUICE_MEMORY_BUDGET" if device == HOST else "SLUICE_GPU_MEMORY_BUDGET"
                where = "this host's memory" if device == HOST else f"{device}'s memory"
                return (
                    f"it holds {format_size(size)} of {where}, more than its whole "
                    f"{setting} ({format_size(budget)})"
                )
        return None

    def _room_elsewhere(self, need: Footprint) -> bool:
        """Whether another live host reports room for ``need`` without evicting."""
        raw = cast(dict[bytes, bytes], self.client.hgetall(self.keys.host_memory))
        for memory in host_memories(raw, CLOCK.now()):
            if memory.host == self.host:
                continue
            if all(
                memory.budget.get(d, 1 << 62) - memory.used.get(d, 0) >= s for d, s in need.items()
            ):
                return True
        return False

    # -- refusals and reports ------------------------------------------------------------

    def _answer_refused(self, key: Version) -> None:
        """Answer every request queued for a refused version with the reason (503)."""
        name, version = key
        model = self.models[name]
        assert model.config is not None
        dynamic = model.config.dynamic_batching
        bases = base_streams(self.keys, name, version, dynamic.priority_levels if dynamic else 0)
        members = tenant_members_sync(self.client, self.keys, [key])
        error = Unavailable(f"model '{name}' version {version} is unavailable: {self.refused[key]}")
        for stream in with_tenants(bases, members[key]):
            entries = cast(list[Any], self.client.xrange(stream, "-", "+", count=1000))
            if not entries:
                continue
            with self.client.pipeline(transaction=False) as pipe:
                for entry_id, fields in entries:
                    try:
                        message, _ = decode_request(fields)
                    except MalformedEntry:
                        pipe.xdel(stream, entry_id)
                        continue
                    reply = ReplyMessage(
                        message.request_key,
                        version,
                        error_kind=error_kind(error),
                        error=error.message,
                    )
                    if self.keys.is_job(message.reply_to):  # (its record takes the answer)
                        keys, args = jobs.finish_call(
                            self.keys, name, version, message.reply_to, reply
                        )
                        pipe.eval(jobs.FINISH, len(keys), *keys, *args)
                    elif message.reply_to:
                        pipe.xadd(
                            message.reply_to,
                            encode_reply(reply),  # type: ignore[arg-type]
                            maxlen=REFUSED_REPLY_MAX_LEN,
                            approximate=True,
                        )
                    pipe.xack(stream, WORKER_GROUP, entry_id)
                    pipe.xdel(stream, entry_id)
                pipe.execute(raise_on_error=False)

    def _report(self) -> None:
        until = CLOCK.now() + STATE_TTL_S
        states = {
            state_field(self.host, *r.key): encode_state(
                *r.key, READY if r.ready_at is not None else LOADING, until
            )
            for r in self.residents.values()
        }
        mine = f"{self.host}/"
        known = [
            f.decode()
            for f in cast(list[bytes], self.client.hkeys(self.keys.on_demand_states))
            if f.decode().startswith(mine)
        ]
        memory = HostMemory(self.host, dict(self.budget), self._used(), until)
        with self.client.pipeline(transaction=False) as pipe:
            gone = [f for f in known if f not in states]
            if gone:
                pipe.hdel(self.keys.on_demand_states, *gone)
            if states:
                pipe.hset(self.keys.on_demand_states, mapping=states)  # type: ignore[arg-type]
            for resident in self.residents.values():  # (this host's claims, renewed)
                pipe.set(self.keys.on_demand_lock(*resident.key), self.host, ex=LOCK_S)
            pipe.hset(self.keys.host_memory, self.host, memory.encode())
            pipe.execute()

    def stop(self) -> None:
        """Take this host's reports out (its workers stop with ``sluice up``)."""
        if self.forks is not None:
            self.forks.stop()
        mine = f"{self.host}/"
        known = [
            f
            for f in cast(list[bytes], self.client.hkeys(self.keys.on_demand_states))
            if f.decode().startswith(mine)
        ]
        with self.client.pipeline(transaction=False) as pipe:
            if known:
                pipe.hdel(self.keys.on_demand_states, *known)
            pipe.hdel(self.keys.host_memory, self.host)
            for resident in self.residents.values():
                pipe.delete(self.keys.on_demand_lock(*resident.key))
            pipe.execute()


def _crashes(child: Child) -> int:
    """The times ``child`` exited other than by failing to load its model."""
    permanent = child.spec.permanent_exit_codes
    return sum(1 for code in child.exit_codes if code not in permanent)


def _files_bytes(directory: Path) -> int:
    """The bytes of the files under ``directory`` (a model version's)."""
    total = 0
    try:
        for path in directory.rglob("*"):
            if path.is_file():
                total += path.stat().st_size
    except OSError:
        pass
    return total
