"""Waiting for the gateways' periodic refresh instead of sleeping for it.

A gateway process reads the catalog, readiness, the workers' hosts and the routing from Redis
every ``SLUICE_CATALOG_REFRESH_S`` (0.5 s), or every ``SLUICE_CATALOG_IDLE_REFRESH_S`` (2 s)
while no request arrives, and a busy machine stretches both: what a test wrote to Redis behind
the gateways' back is in their view only once they have refreshed since. Each refresh ends
with the process's report, which moves its expiry in ``Keys.gateways`` forward. The first
report seen after a change may close a refresh that read Redis before the change; the one
after it closes a refresh that began after the change. So :func:`wait_for_refresh` waits for
two reports of every live gateway process.
"""

from __future__ import annotations

from typing import cast

from redis import Redis

from sluice.core.keys import Keys
from tests.support.procs import wait_until


def _expiries(redis: Redis, keys: Keys) -> dict[bytes, float]:
    members = cast(list[tuple[bytes, float]], redis.zrange(keys.gateways, 0, -1, withscores=True))
    return {member: float(expiry) for member, expiry in members}


def wait_for_refresh(redis: Redis, keys: Keys, timeout_s: float = 30.0) -> bool:
    """Whether every gateway process live now refreshed twice (so once wholly after this
    call began) within ``timeout_s``; False also when no gateway process is live."""
    last = _expiries(redis, keys)
    reports = dict.fromkeys(last, 0)

    def refreshed() -> bool:
        for member, expiry in _expiries(redis, keys).items():
            if member in last and expiry > last[member]:
                reports[member] += 1
            last[member] = expiry
        return bool(reports) and all(count >= 2 for count in reports.values())

    return wait_until(refreshed, timeout_s)
