"""Sluice's own metric families (``sluice_*``), written with prometheus-client.

They describe what Triton has no name for: the queue (stream length, entries waiting and
held by workers, the oldest request's age, an estimated drain time), recovery (reclaimed
and dead-lettered entries), refusals and deadline misses, instances by state, latency and
batch-size histograms, and the gateways (in flight, Redis round trip, shared memory).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from sluice.core.observability import histograms as hist
from sluice.core.observability import statistics as st
from sluice.core.on_demand import EVICTION_REASONS, eviction_field
from sluice.gateway.control.gateway_report import (
    BODY_BUDGET_REJECTS,
    CLIENT_SHM_BYTES,
    CLIENT_SHM_HOST,
    IN_FLIGHT,
    ROUND_TRIP_US,
)
from sluice.gateway.metrics.snapshot import Snapshot, VersionState

_LABELS = ["model", "version"]
_HISTOGRAMS = (
    (
        "sluice_request_duration_seconds",
        "Time from the gateway's enqueue to the worker's answer, successful requests",
        hist.REQUEST,
    ),
    (
        "sluice_queue_duration_seconds",
        "Time from the gateway's enqueue to the start of the batch's computation",
        hist.QUEUE,
    ),
    (
        "sluice_compute_duration_seconds",
        "Input preparation, inference and output extraction of the request's batch",
        hist.COMPUTE,
    ),
    ("sluice_batch_size", "Items per model execution (Triton's inference count)", hist.BATCH_SIZE),
    (
        "sluice_batch_wait_seconds",
        "Time from a batch's first request held by the worker to the batch's computation",
        hist.BATCH_WAIT,
    ),
    (
        "sluice_batch_cost_model_error_ratio",
        "How far adaptive batching's cost model missed a batch's cost: "
        "|predicted - measured| / measured",
        hist.COST_MODEL_ERROR,
    ),
    (
        "sluice_model_cold_start_seconds",
        "Loads of an on-demand model version: from its oldest waiting request's arrival to "
        "its workers' first heartbeat",
        hist.COLD_START,
    ),
)


@dataclass
class DrainRate:
    """Answers per second per model version, from the counters seen at recent scrapes (a
    sample a second at most, however often they come: a version holds a window's worth)."""

    window_s: float = 60.0
    seen: dict[tuple[str, int], deque[tuple[float, int]]] = field(default_factory=dict)

    def rate(self, key: tuple[str, int], answered: int, now: float) -> float | None:
        samples = self.seen.setdefault(key, deque())
        if len(samples) < 2 or now - samples[-2][0] >= 1.0:
            samples.append((now, answered))
        else:
            samples[-1] = (now, answered)
        while len(samples) > 2 and now - samples[1][0] >= self.window_s:
            samples.popleft()
        first_t, first_count = samples[0]
        if now - first_t < 1.0:
            return None
        return max(0, answered - first_count) / (now - first_t)

    def keep_only(self, keys: Collection[tuple[str, int]]) -> None:
        """Forget the versions not in ``keys`` (no longer served)."""
        for key in [key for key in self.seen if key not in keys]:
            del self.seen[key]


DRAIN = DrainRate()


@dataclass(eq=False)
class _Families:
    snapshot: Snapshot
    shm_segment_bytes: int | None
    tenants: Collection[str] | None = None
    """The tenants that exist: per-tenant series of others (gone with their keys) are left
    out. None: every tenant's."""

    namespaced: bool = field(init=False, default=False)
    """The models have a namespace (model namespacing): every family with model labels
    labels each series by it too, as Triton's families do."""
    label_names: list[str] = field(init=False, default_factory=list)
    """Each family's model labels."""

    def __post_init__(self) -> None:
        self.namespaced = any(state.namespace for state in self.snapshot.versions)
        self.label_names = ["model", "namespace", "version"] if self.namespaced else _LABELS

    def _labels(self, state: VersionState) -> list[str]:
        """A version's label values: the name clients use (never a copy's internal name),
        and with namespacing its repository."""
        model = state.listed_as or state.model
        if self.namespaced:
            return [model, state.namespace, str(state.version)]
        return [model, str(state.version)]

    def collect(self) -> Iterator[Metric]:
        versions = self.snapshot.versions
        yield from self._queue(versions)
        yield from self._recovery(versions)
        yield from self._instances(versions)
        yield from self._batch_closes(versions)
        yield from self._histograms(versions)
        yield from self._on_demand(versions)
        yield from self._gateways()

    def _queue(self, versions: list[VersionState]) -> Iterable[Metric]:
        length = GaugeMetricFamily(
            "sluice_stream_length",
            "Entries in the model version's request stream (waiting and being computed)",
            labels=[*self.label_names, "priority"],
        )
        lag = GaugeMetricFamily(
            "sluice_consumer_lag",
            "Entries not yet delivered to any worker (the consumer group's lag)",
            labels=self.label_names,
        )
        pending = GaugeMetricFamily(
            "sluice_pending_entries",
            "Entries delivered to a worker and not yet answered",
            labels=self.label_names,
        )
        age = GaugeMetricFamily(
            "sluice_oldest_request_age_seconds",
            "Age of the oldest request not yet answered (0 when none)",
            labels=self.label_names,
        )
        drain = GaugeMetricFamily(
            "sluice_drain_time_seconds",
            "Estimated time to answer every queued request at the recent answer rate "
            "(+Inf when requests wait and none was answered lately, NaN until two scrapes)",
            labels=self.label_names,
        )
        now = time.monotonic()
        for state in versions:
            labels = self._labels(state)
            for stream in state.streams:
                length.add_metric([*labels, str(stream.priority)], stream.length)
            lag.add_metric(labels, sum(s.waiting for s in state.streams))
            pending.add_metric(labels, sum(s.delivered for s in state.streams))
            oldest = [s.oldest_ms for s in state.streams if s.oldest_ms is not None]
            age.add_metric(
                labels, max(0.0, (self.snapshot.now_ms - min(oldest)) / 1000) if oldest else 0.0
            )
            queued = sum(s.length for s in state.streams)
            answered = state.counters.get(st.count_field("success"), 0) + state.counters.get(
                st.count_field("fail"), 0
            )
            rate = DRAIN.rate((state.model, state.version), answered, now)
            if queued == 0:
                estimate = 0.0
            elif rate is None:
                estimate = math.nan
            else:
                estimate = queued / rate if rate > 0 else math.inf
            drain.add_metric(labels, estimate)
        DRAIN.keep_only({(state.model, state.version) for state in versions})
        return length, lag, pending, age, drain

    def _recovery(self, versions: list[VersionState]) -> Iterable[Metric]:
        reclaimed = CounterMetricFamily(
            "sluice_reclaimed_entries",
            "Entries a worker took over from a dead or stuck worker",
            labels=self.label_names,
        )
        dead = CounterMetricFamily(
            "sluice_dead_letter_entries",
            "Entries moved to the dead-letter stream after too many deliveries",
            labels=self.label_names,
        )
        misses = CounterMetricFamily(
            "sluice_deadline_misses",
            "Requests whose deadline passed, in the queue or waiting at the gateway",
            labels=[*self.label_names, "stage"],
        )
        rejects = CounterMetricFamily(
            "sluice_admission_rejects",
            "Requests a gateway refused before queueing them, by reason",
            labels=[*self.label_names, "reason"],
        )
        decisions = CounterMetricFamily(
            "sluice_rollout_decisions",
            "Decisions of rollouts with this version as the candidate (start, step, passed, "
            "inconclusive, promote, rollback, promoted, rolled_back)",
            labels=[*self.label_names, "decision"],
        )
        jobs = CounterMetricFamily(
            "sluice_jobs",
            "Asynchronous jobs of this version, by outcome (submitted, completed, failed, "
            "expired: deadline passed in the queue, cancelled)",
            labels=[*self.label_names, "outcome"],
        )
        batch_rows = CounterMetricFamily(
            "sluice_batch_rows",
            "Rows of offline batch jobs this version answered (a rate of it: rows/s)",
            labels=self.label_names,
        )
        shard_retries = CounterMetricFamily(
            "sluice_batch_shard_retries",
            "Attempts of batch-job shards after their first (a worker lost, an error)",
            labels=self.label_names,
        )
        for state in versions:
            labels = self._labels(state)
            counters = state.counters
            batch_rows.add_metric(labels, counters.get(st.BATCH_ROWS, 0))
            shard_retries.add_metric(labels, counters.get(st.BATCH_SHARD_RETRIES, 0))
            for outcome in st.JOB_OUTCOMES:
                jobs.add_metric([*labels, outcome], counters.get(st.job_field(outcome), 0))
            for name, count in sorted(counters.items()):
                decision = st.rollout_decision(name)
                if decision is not None:
                    decisions.add_metric([*labels, decision], count)
            reclaimed.add_metric(labels, counters.get(st.RECLAIMED, 0))
            dead.add_metric(labels, counters.get(st.DEAD_LETTERED, 0))
            for stage in st.DEADLINE_MISS_STAGES:
                misses.add_metric([*labels, stage], counters.get(st.deadline_miss_field(stage), 0))
            for reason in st.ADMISSION_REJECT_REASONS:
                rejects.add_metric([*labels, reason], counters.get(st.reject_field(reason), 0))
        return reclaimed, dead, misses, rejects, decisions, jobs, batch_rows, shard_retries

    def _instances(self, versions: list[VersionState]) -> Iterable[Metric]:
        instances = GaugeMetricFamily(
            "sluice_instances",
            "Model instances (worker processes) by state: ready (heartbeating), loading "
            "(expected, not yet ready) and failed (the version could not be loaded)",
            labels=[*self.label_names, "state"],
        )
        for state in versions:
            labels = self._labels(state)
            missing = max(0, state.expected_instances - state.live_workers)
            instances.add_metric([*labels, "ready"], state.live_workers)
            instances.add_metric([*labels, "loading"], 0 if state.load_error else missing)
            instances.add_metric([*labels, "failed"], missing if state.load_error else 0)
        return (instances,)

    def _batch_closes(self, versions: list[VersionState]) -> Iterable[Metric]:
        closes = CounterMetricFamily(
            "sluice_batch_closes",
            "Batches by why they closed: full (max_batch_size), preferred (a preferred size), "
            "window (max_queue_delay ran out), adaptive (waiting no longer paid), stopping",
            labels=[*self.label_names, "reason"],
        )
        for state in versions:
            labels = self._labels(state)
            for reason in st.BATCH_CLOSE_REASONS:
                closes.add_metric(
                    [*labels, reason], state.counters.get(st.batch_close_field(reason), 0)
                )
        return (closes,)

    def _histograms(self, versions: list[VersionState]) -> Iterable[Metric]:
        for name, help_text, histogram in _HISTOGRAMS:
            family = HistogramMetricFamily(name, help_text, labels=self.label_names)
            for state in versions:
                buckets, total = histogram.read(state.counters)
                family.add_metric(self._labels(state), buckets, total)
            yield family
        tenants = HistogramMetricFamily(
            "sluice_tenant_queue_duration_seconds",
            "Time from the gateway's enqueue to the start of the batch's computation, per "
            "tenant (requests of named tenants)",
            labels=[*self.label_names, "tenant"],
        )
        for state in versions:
            for tenant in hist.tenant_queue_tenants(state.counters):
                if self.tenants is not None and tenant not in self.tenants:
                    continue
                buckets, total = hist.tenant_queue(tenant).read(state.counters)
                tenants.add_metric([*self._labels(state), tenant], buckets, total)
        yield tenants

    def _on_demand(self, versions: list[VersionState]) -> Iterable[Metric]:
        evictions = CounterMetricFamily(
            "sluice_model_evictions",
            "On-demand model versions unloaded: budget (to make room for another), refused "
            "(measured larger than the whole budget)",
            labels=[*self.label_names, "reason"],
        )
        for state in versions:
            for reason in EVICTION_REASONS:
                count = state.counters.get(eviction_field(reason), 0)
                evictions.add_metric([*self._labels(state), reason], count)
        budget = GaugeMetricFamily(
            "sluice_memory_budget_bytes",
            "Memory the model workers of a host may hold together, by device "
            "(SLUICE_MEMORY_BUDGET, SLUICE_GPU_MEMORY_BUDGET)",
            labels=["host", "device"],
        )
        used = GaugeMetricFamily(
            "sluice_memory_used_bytes",
            "Memory the model workers of a host hold, measured, by device",
            labels=["host", "device"],
        )
        for host in self.snapshot.hosts:
            for device, size in sorted(host.budget.items()):
                budget.add_metric([host.host, device], size)
                used.add_metric([host.host, device], host.used.get(device, 0))
        return evictions, budget, used

    def _gateways(self) -> Iterable[Metric]:
        gateways = self.snapshot.gateways
        in_flight = GaugeMetricFamily(
            "sluice_gateway_in_flight", "Requests held by the live gateway processes"
        )
        in_flight.add_metric([], sum(g.get(IN_FLIGHT, 0) for g in gateways))
        processes = GaugeMetricFamily(
            "sluice_gateway_processes", "Gateway processes that reported in the last seconds"
        )
        processes.add_metric([], len(gateways))
        round_trip = GaugeMetricFamily(
            "sluice_redis_round_trip_seconds",
            "Slowest Redis round trip the live gateways measured at their last refresh",
        )
        round_trip.add_metric([], max((g.get(ROUND_TRIP_US, 0) for g in gateways), default=0) / 1e6)
        body = CounterMetricFamily(
            "sluice_gateway_body_budget_rejects",
            "Requests refused because the gateway held SLUICE_MAX_BUFFERED_BODY_BYTES already",
        )
        body.add_metric([], self.snapshot.gateway_counters.get(BODY_BUDGET_REJECTS, 0))
        shm = GaugeMetricFamily(
            "sluice_shared_memory_bytes",
            "Shared memory in use: gateway-worker segments on this host, and the client "
            "regions registered with the live gateways",
            labels=["kind"],
        )
        shm.add_metric(["segments"], self.shm_segment_bytes or 0)
        per_host: dict[int, int] = {}  # (each process of a host reports the host's regions)
        for g in gateways:
            host = g.get(CLIENT_SHM_HOST, 0)
            per_host[host] = max(per_host.get(host, 0), g.get(CLIENT_SHM_BYTES, 0))
        shm.add_metric(["client_regions"], sum(per_host.values()))
        return in_flight, processes, round_trip, body, shm


def render(
    snapshot: Snapshot, shm_segment_bytes: int | None, tenants: Collection[str] | None = None
) -> bytes:
    """The families; ``tenants``: those that exist (see :attr:`_Families.tenants`)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(snapshot, shm_segment_bytes, tenants))
    return generate_latest(registry)
