"""A worker's custom metrics report (:mod:`sluice.core.observability.custom_metrics`) goes
to Redis with its heartbeat: written when it changed, its expiry moved on every beat, and
written again once Redis no longer holds it."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator

import pytest
from redis.asyncio import Redis

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
    counter = pb_utils.MetricFamily("made", "Made", pb_utils.MetricFamily.COUNTER).Metric()

    async def made() -> float:
        [family] = json.loads(await redis.hget(keys.custom_metrics, "w1"))["families"]
        return float(family["series"][0]["value"])

    try:
        counter.increment(1)
        await liveness.beat()
        assert await made() == 1
        first_expiry = await redis.zscore(keys.custom_metrics_expiry, "w1")
        await redis.hset(keys.custom_metrics, "w1", b"marker")  # (shows a rewrite)
        await asyncio.sleep(0.01)
        await liveness.beat()  # unchanged: its expiry moves, the report is not rewritten
        assert await redis.hget(keys.custom_metrics, "w1") == b"marker"
        assert await redis.zscore(keys.custom_metrics_expiry, "w1") > first_expiry
        counter.increment(1)
        await liveness.beat()  # changed: written
        assert await made() == 2
        await redis.hdel(keys.custom_metrics, "w1")  # Redis restarted, say
        await liveness.beat()  # finds it gone ...
        await liveness.beat()  # ... and writes it again
        assert await made() == 2
    finally:
        await redis.aclose()
