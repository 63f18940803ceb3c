"""The deployment's clock: Unix time as the Redis server tells it.

Deadlines and enqueue times travel in stream entries: a gateway writes them, a worker on
another host compares them with its own time. So every process reads time as its own clock
plus its offset from Redis's clock (``TIME``, corrected by half the round trip), and two
hosts agree to within their round trips to Redis whatever their clocks say. On Redis's own
host (and any whose clock agrees with it) every process keeps its own clock, exactly.

Each measurement's error is at most half its round trip, so the offset kept is that of the
fastest of the recent measurements, moved toward zero by that half: only what is certain is
corrected (within a round trip of the truth), and a clock that agrees with Redis's as far
as can be measured, as every clock of Redis's own host does, is not corrected at all.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field

from redis import Redis as SyncRedis
from redis.asyncio import Redis

_SAMPLES = 30
"""Measurements the offset is chosen among (one a second: the last half minute)."""


@dataclass
class DeploymentClock:
    offset_ns: int = 0
    _samples: deque[tuple[int, int]] = field(default_factory=lambda: deque(maxlen=_SAMPLES))
    """(round trip, offset) of the recent measurements."""
    _lock: threading.Lock = field(default_factory=threading.Lock)
    """Batch workers measure from more than one thread."""

    def now_ns(self) -> int:
        """Unix time in ns on the deployment's clock."""
        return time.time_ns() + self.offset_ns

    def now(self) -> float:
        """Unix time in seconds on the deployment's clock: what every timestamp that another
        process (perhaps on another host) compares with its own time is written in, such as
        heartbeats, leases and deadlines."""
        return (time.time_ns() + self.offset_ns) / 1e9

    def observe(self, sent_ns: int, redis_ns: int, received_ns: int) -> None:
        """One measurement: Redis said ``redis_ns`` between ``sent_ns`` and ``received_ns``
        (this process's clock)."""
        round_trip = max(0, received_ns - sent_ns)
        with self._lock:
            self._samples.append((round_trip, redis_ns - (sent_ns + received_ns) // 2))
            best_round_trip, estimate = min(self._samples)
            self.offset_ns = _least_correction(estimate, best_round_trip // 2)

    async def sync(self, redis: Redis) -> None:
        """Measure against ``redis`` (Redis errors propagate; the offset stays)."""
        sent = time.time_ns()
        seconds, micros = await redis.time()
        received = time.time_ns()
        self.observe(sent, int(seconds) * 1_000_000_000 + int(micros) * 1_000, received)

    def sync_blocking(self, redis: SyncRedis) -> None:
        """:meth:`sync` with a blocking client (batch jobs' workers)."""
        sent = time.time_ns()
        seconds, micros = redis.time()
        received = time.time_ns()
        self.observe(sent, int(seconds) * 1_000_000_000 + int(micros) * 1_000, received)


def _least_correction(estimate_ns: int, uncertainty_ns: int) -> int:
    """The offset nearest zero that the measurement allows: the true one lies within
    ``uncertainty_ns`` of ``estimate_ns``. A clock that agrees with Redis's as far as can be
    measured is left alone, so that processes of one host (one clock) keep exactly the same
    time, and durations one measures from another's timestamps never come out negative."""
    if abs(estimate_ns) <= uncertainty_ns:
        return 0
    return estimate_ns - uncertainty_ns if estimate_ns > 0 else estimate_ns + uncertainty_ns


CLOCK = DeploymentClock()
"""This process's view of the deployment's clock (gateways and workers keep it in sync)."""
