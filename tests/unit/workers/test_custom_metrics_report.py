"""A worker's custom metrics report (:mod:`sluice.core.observability.custom_metrics`) goes
to Redis with its heartbeat: written when it changed, its expiry moved on every beat (on the
deployment clock), written again once Redis no longer holds it, and taken back once the
model has no family left."""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from collections.abc import Iterator

import pytest
from redis.asyncio import Redis

from sluice.core.clock import CLOCK
from sluice.core.keys import Keys
from sluice.core.observability import custom_metrics as cm
from sluice.core.settings import WorkerSettings
from sluice.scheduler.executor.redis_server import RedisServer
from sluice.workers.backends import triton_python_backend_utils as pb_utils
from sluice.workers.liveness import Liveness


@pytest.fixture(autouse=True)
def fresh_registry(monkeypatch: pytest.MonkeyPatch) -> Iterator[cm.Registry]:
    registry = cm.Registry()
    monkeypatch.setattr(cm, "REGISTRY", registry)
    yield registry


async def test_an_unchanged_report_is_not_written_again_until_redis_lost_it(
    redis_server: RedisServer,
) -> None:
    settings = WorkerSettings(namespace=f"cm{time.monotonic_ns()}", heartbeat_s=1.0)
    keys = Keys(settings.namespace)
    redis = Redis.from_url(redis_server.url)
    liveness = Liveness(redis, keys, settings, "m", 1, "w1", "host", asyncio.Event())
    family = pb_utils.MetricFamily("made", "Made", pb_utils.MetricFamily.COUNTER)
    counter = family.Metric()

    async def made() -> float:
        raw = await redis.hget(keys.custom_metrics, "w1")
        assert raw is not None
        [reported] = json.loads(raw)["families"]
        return float(reported["series"][0]["value"])

    try:
        counter.increment(1)
        await liveness.beat()
        assert await made() == 1
        first_expiry = await redis.zscore(keys.custom_metrics_expiry, "w1")
        await redis.hset(keys.custom_metrics, "w1", b"marker")  # (shows a rewrite)
        await asyncio.sleep(0.01)
        await liveness.beat()  # unchanged: its expiry moves, the report is not rewritten
        assert await redis.hget(keys.custom_metrics, "w1") == b"marker"
        moved = await redis.zscore(keys.custom_metrics_expiry, "w1")
        assert moved is not None and first_expiry is not None and moved > first_expiry
        counter.increment(1)
        await liveness.beat()  # changed: written
        assert await made() == 2
        await redis.hdel(keys.custom_metrics, "w1")  # Redis restarted, say
        await liveness.beat()  # finds it gone ...
        await liveness.beat()  # ... and writes it again
        assert await made() == 2
    finally:
        await redis.aclose()


async def test_the_report_is_taken_back_when_the_model_deletes_its_last_family(
    redis_server: RedisServer,
) -> None:
    """Triton deletes a family's series with its ``MetricFamily`` object: the next beat
    takes the report back rather than leaving it to show until it expires."""
    settings = WorkerSettings(namespace=f"cm{time.monotonic_ns()}", heartbeat_s=60.0)
    keys = Keys(settings.namespace)
    redis = Redis.from_url(redis_server.url)
    liveness = Liveness(redis, keys, settings, "m", 1, "w1", "host", asyncio.Event())
    family = pb_utils.MetricFamily("made", "Made", pb_utils.MetricFamily.COUNTER)
    family.Metric().increment(1)
    try:
        await liveness.beat()
        assert await redis.hexists(keys.custom_metrics, "w1")
        del family
        await liveness.beat()
        assert not await redis.hexists(keys.custom_metrics, "w1")
        assert await redis.zscore(keys.custom_metrics_expiry, "w1") is None
        assert await redis.zscore(keys.live_workers("m", 1), "w1") is not None  # (still live)
        await liveness.beat()  # (nothing more to take back)
        await liveness.leave()
        assert not await redis.exists(keys.live_workers("m", 1))
    finally:
        await redis.aclose()


async def test_the_expiry_is_on_the_deployment_clock(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker whose host clock is a minute behind Redis's writes an expiry that a scrape
    elsewhere (on Redis's time) finds ahead: its report is not dropped as expired."""
    settings = WorkerSettings(namespace=f"cm{time.monotonic_ns()}", heartbeat_s=1.0)
    keys = Keys(settings.namespace)
    redis = Redis.from_url(redis_server.url)
    liveness = Liveness(redis, keys, settings, "m", 1, "w1", "host", asyncio.Event())
    family = pb_utils.MetricFamily("made", "Made", pb_utils.MetricFamily.COUNTER)
    family.Metric().increment(1)
    behind_s = 60
    real_time, real_time_ns = time.time, time.time_ns
    monkeypatch.setattr(CLOCK, "offset_ns", 0)
    monkeypatch.setattr(CLOCK, "_samples", deque(maxlen=30))
    try:
        monkeypatch.setattr(time, "time", lambda: real_time() - behind_s)
        monkeypatch.setattr(time, "time_ns", lambda: real_time_ns() - behind_s * 10**9)
        await liveness.beat()
        monkeypatch.setattr(time, "time", real_time)
        monkeypatch.setattr(time, "time_ns", real_time_ns)
        expires = await redis.zscore(keys.custom_metrics_expiry, "w1")
        seconds, micros = await redis.time()
        assert expires is not None
        assert expires > seconds + micros / 1e6 + 2  # (three beats ahead of Redis's time)
    finally:
        await redis.aclose()
