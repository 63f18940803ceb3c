"""Latency and batch-size histograms kept as counters in Redis.

A worker adds each batch's observations to its model version's statistics hash: one field
per bucket (not cumulative, so that an observation touches one field) and one for the sum.
The gateway reads the hash and renders Prometheus histograms with cumulative buckets. As
every worker adds to the same fields, the histogram covers all of them, on every host,
and ``histogram_quantile`` over it is correct; a restarted worker takes nothing away.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property, lru_cache

_LATENCY_BOUNDS_S = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)
_BATCH_BOUNDS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
_WAIT_BOUNDS_S = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1, 1.0)
_COLD_START_BOUNDS_S = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_RATIO_BOUNDS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0)
RATIO_UNIT = 1000
"""Ratios are recorded in thousandths (the hash holds integers)."""


@dataclass(frozen=True)
class Histogram:
    key: str
    """Field prefix in the statistics hash."""
    bounds: tuple[float, ...]
    """Upper bounds in exported units (seconds, items), +Inf implied."""
    unit: float
    """Recorded integer units per exported unit (1e9 for nanoseconds)."""

    @cached_property
    def _recorded_bounds(self) -> tuple[int, ...]:
        return tuple(round(bound * self.unit) for bound in self.bounds)

    @cached_property
    def _bucket_fields(self) -> tuple[str, ...]:
        return tuple(self.bucket_field(index) for index in range(len(self.bounds) + 1))

    def bucket(self, value: int) -> int:
        """Index of the bucket ``value`` (recorded units) falls in: the first bound >= it."""
        return bisect_left(self._recorded_bounds, value)

    def bucket_field(self, index: int) -> str:
        return f"h.{self.key}.{index}"

    @property
    def sum_field(self) -> str:
        return f"h.{self.key}.sum"

    def observe(self, counters: dict[str, int], value: int, times: int = 1) -> None:
        """Add ``times`` observations of ``value`` (recorded units) to ``counters``."""
        field = self._bucket_fields[bisect_left(self._recorded_bounds, value)]
        counters[field] = counters.get(field, 0) + times
        counters[self.sum_field] = counters.get(self.sum_field, 0) + value * times

    def observe_all(self, counters: dict[str, int], values: list[int]) -> None:
        """Add one observation of each of ``values`` (a batch's requests)."""
        bounds, fields = self._recorded_bounds, self._bucket_fields
        for value in values:
            field = fields[bisect_left(bounds, value)]
            counters[field] = counters.get(field, 0) + 1
        counters[self.sum_field] = counters.get(self.sum_field, 0) + sum(values)

    def read(self, counters: Mapping[str, int]) -> tuple[list[tuple[str, float]], float]:
        """Cumulative buckets as (le, count), +Inf last, and the sum in exported units."""
        buckets: list[tuple[str, float]] = []
        total = 0
        for index, bound in enumerate((*self.bounds, float("inf"))):
            total += counters.get(self.bucket_field(index), 0)
            buckets.append((_le(bound), total))
        return buckets, counters.get(self.sum_field, 0) / self.unit


def _le(bound: float) -> str:
    if bound == float("inf"):
        return "+Inf"
    return repr(float(bound))


REQUEST = Histogram("request", _LATENCY_BOUNDS_S, 1e9)
"""Enqueued by the gateway to answered by the worker, successful requests."""
QUEUE = Histogram("queue", _LATENCY_BOUNDS_S, 1e9)
"""Enqueued to the start of the batch's computation."""
COMPUTE = Histogram("compute", _LATENCY_BOUNDS_S, 1e9)
"""Input preparation, inference and output extraction of the request's batch."""
BATCH_SIZE = Histogram("batch", _BATCH_BOUNDS, 1)
"""Items (Triton's inference count) per model execution."""
BATCH_WAIT = Histogram("batch_wait", _WAIT_BOUNDS_S, 1e9)
"""From a batch's first request held to the batch going to compute."""
COST_MODEL_ERROR = Histogram("cost_error", _RATIO_BOUNDS, RATIO_UNIT)
"""|predicted - measured| / measured cost of a batch (see :mod:`sluice.workers.adaptive`)."""

COLD_START = Histogram("cold_start", _COLD_START_BOUNDS_S, 1e9)
"""An on-demand model version's load: from its oldest waiting request's arrival to its
workers' first heartbeat (:mod:`sluice.scheduler.executor.on_demand`)."""

TENANT_QUEUE_PREFIX = "tq."
"""Key prefix of the per-tenant queue time histograms (:func:`tenant_queue`)."""


@lru_cache(maxsize=1024)
def tenant_queue(tenant: str) -> Histogram:
    """One tenant's :data:`QUEUE` histogram (requests of named tenants only): whether a
    tenant's requests wait behind another's (:mod:`sluice.workers.fair_share`)."""
    return Histogram(TENANT_QUEUE_PREFIX + tenant, _LATENCY_BOUNDS_S, 1e9)


def tenant_queue_tenants(counters: Mapping[str, int]) -> list[str]:
    """The tenants whose queue time histograms ``counters`` (a statistics hash) holds."""
    prefix, suffix = f"h.{TENANT_QUEUE_PREFIX}", ".sum"
    return sorted(
        field[len(prefix) : -len(suffix)]
        for field in counters
        if field.startswith(prefix) and field.endswith(suffix)
    )
