"""Heartbeats between hosts whose clocks disagree.

A worker's heartbeat is a score in Redis, "alive until": written by the worker, read by the
other workers (which take over a dead one's requests at once), by gateways (readiness) and
by ``sluice up``. Written and read on each host's own clock, a host whose clock runs ahead
would see every other worker as dead and take their requests while they compute them. On
the deployment's clock (Redis's, :mod:`sluice.core.clock`), it does not.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from redis.asyncio import Redis

from sluice.core.clock import CLOCK
from sluice.core.keys import WORKER_GROUP, Keys
from sluice.core.settings import WorkerSettings
from sluice.scheduler.executor.redis_server import RedisServer
from sluice.workers.liveness import Liveness
from sluice.workers.reclaim import Reclaimer

SKEW_S = 90.0


@pytest.fixture
def host_clock(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[float], None]]:
    """Set this process's wall clock ``skew`` seconds off the real one (another host), with
    a deployment clock that has measured nothing yet."""
    real_time, real_time_ns = time.time, time.time_ns

    def skew_to(seconds: float) -> None:
        monkeypatch.setattr(time, "time", lambda: real_time() + seconds)
        monkeypatch.setattr(time, "time_ns", lambda: real_time_ns() + int(seconds * 1e9))
        monkeypatch.setattr(CLOCK, "_samples", deque(maxlen=30))
        monkeypatch.setattr(CLOCK, "offset_ns", 0)

    yield skew_to


class _Publisher:
    def __init__(self) -> None:
        self.published: list[Any] = []

    async def publish(self, outcomes: list[Any]) -> None:
        self.published += outcomes


async def test_a_host_whose_clock_runs_ahead_sees_the_others_alive(
    redis_server: RedisServer, host_clock: Callable[[float], None]
) -> None:
    settings = WorkerSettings(namespace=f"clk{time.monotonic_ns()}")
    keys = Keys(settings.namespace)
    redis = Redis.from_url(redis_server.url)
    stream = keys.request_stream("m", 1)
    try:
        await redis.xgroup_create(stream, WORKER_GROUP, id="0", mkstream=True)
        # Host A, its clock 90 s behind: a worker beats and takes a request.
        host_clock(-SKEW_S)
        worker = Liveness(redis, keys, settings, "m", 1, "worker-on-a", "a", asyncio.Event())
        await worker.beat()
        await redis.xadd(stream, {b"x": b"1"})
        await redis.xreadgroup(WORKER_GROUP, worker.worker_id, {stream: ">"}, count=1)

        # Host B, its clock 90 s ahead: a worker of the same model looks for dead workers.
        host_clock(SKEW_S)
        parsed: list[bytes] = []
        reclaimer = Reclaimer(
            redis,
            keys,
            settings,
            "m",
            1,
            "worker-on-b",
            [stream],
            lambda entry_id, *_: parsed.append(entry_id),  # type: ignore[arg-type,func-returns-value]
            _Publisher(),  # type: ignore[arg-type]
        )
        await CLOCK.sync(redis)  # (every worker does with each heartbeat)
        assert await reclaimer.reclaim() == []
        assert parsed == [], "B took the request of A, which is alive and computing it"
        pending = await redis.xpending(stream, WORKER_GROUP)
        assert pending["consumers"] == [{"name": worker.worker_id.encode(), "pending": 1}]

        # A stops beating: three beats later B takes its request, whatever the clocks say.
        await redis.zadd(keys.live_workers("m", 1), {worker.worker_id: CLOCK.now() - 0.1})
        await reclaimer.reclaim()
        assert len(parsed) == 1
    finally:
        await redis.delete(stream, keys.live_workers("m", 1), keys.worker_hosts("m", 1))
        await redis.aclose()
