"""Room left in Redis: new work is refused before Redis fills up.

Everything the gateway accepts (an inference request's entry, a job's entry and record, a
batch job) is written to Redis. A Redis at its ``maxmemory`` (with ``noeviction``, the only
policy under which queued work is safe) refuses writes, so that requests already accepted
could not even be answered; with an evicting policy it would silently drop them. So the
gateway learns Redis's memory in its periodic refresh (``INFO memory``, never per request)
and, above ``SLUICE_REDIS_MEMORY_HIGH_WATER`` of ``maxmemory``, refuses what would add to
Redis with 503 and ``Retry-After`` until enough has drained. Answers, status reads and
cancellations go on: they are what frees the room.

On a Redis Cluster the fullest primary decides (a model's keys all live on one of them).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from sluice.core.errors import Overloaded

RETRY_AFTER_S = 5
"""What a refused client is told to wait: Redis drains as workers answer."""


@dataclass
class RedisRoom:
    high_water: float
    """Fraction of ``maxmemory`` above which new work is refused (0: never)."""
    used_bytes: int = 0
    max_bytes: int = 0
    """Redis's ``maxmemory`` (0: none set, nothing is refused)."""
    full: bool = False
    """Whether new work is refused now: what the request paths look at."""

    def observe(self, memory: Iterable[Mapping[str, Any]]) -> None:
        """Take ``INFO memory`` of every primary (one for a single Redis)."""
        fullest: tuple[float, int, int] = (0.0, 0, 0)
        for info in memory:
            used, limit = _int(info.get("used_memory")), _int(info.get("maxmemory"))
            share = used / limit if limit > 0 else 0.0
            if limit > 0 and share >= fullest[0]:
                fullest = (share, used, limit)
        share, self.used_bytes, self.max_bytes = fullest
        self.full = self.high_water > 0 and self.max_bytes > 0 and share >= self.high_water

    async def refresh(self, redis: Redis | RedisCluster) -> None:
        """Read Redis's memory now (the gateway's periodic refresh calls this)."""
        if isinstance(redis, RedisCluster):
            found = await redis.info("memory", target_nodes=RedisCluster.PRIMARIES)
            self.observe(found.values())
        else:
            self.observe([await redis.info("memory")])

    @property
    def share(self) -> float:
        """Part of ``maxmemory`` in use (0 without one)."""
        return self.used_bytes / self.max_bytes if self.max_bytes > 0 else 0.0

    def check(self) -> None:
        """Refuse new work while Redis is above its high-water mark: :class:`Overloaded`
        (503 + Retry-After) naming why. A boolean test otherwise: call it per request."""
        if self.full:
            raise Overloaded(
                f"Redis is {self.share:.0%} full (its maxmemory); retry later", RETRY_AFTER_S
            )


def _int(value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0
