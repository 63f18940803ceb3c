"""A batch's planning that meets Redis (or its name) out of reach for a moment is tried
again rather than left `planning` for good; one that fails for good (the retries spent, or
an error no retry mends) ends the job failed, saying why, instead of leaving it `planning`
for good (it then never expired, and held its upload for ever)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from redis import Redis
from redis.exceptions import ConnectionError as RedisConnectionError

from sluice.batch.app import create_app
from sluice.batch.runner import Runner
from sluice.core.batch_jobs import batches as b
from sluice.core.batch_jobs import uploads as u
from sluice.core.keys import Keys
from sluice.core.settings import BatchSettings
from sluice.scheduler.executor.redis_server import RedisServer


@pytest.fixture(scope="module")
def batch_app(
    tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer
) -> Iterator[tuple[Any, Runner, str]]:
    """One batch worker's Celery app and runner for the module (Celery keeps the first
    callable registered under a task name in a process): its app, runner and namespace."""
    namespace = f"t{uuid.uuid4().hex[:8]}"
    settings = BatchSettings(
        redis_url=redis_server.url,
        namespace=namespace,
        batch_store=str(tmp_path_factory.mktemp("store")),
    )
    app, runner = create_app(settings)
    yield app, runner, namespace
    runner.close()


def test_a_plan_that_meets_redis_away_is_tried_again(
    batch_app: tuple[Any, Runner, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    app, runner, _ = batch_app
    calls: list[str] = []

    def plan(batch_id: str, resume: bool) -> None:
        calls.append(batch_id)
        if len(calls) < 3:
            raise RedisConnectionError("Error -3 connecting to redis:6379. Temporary failure")

    monkeypatch.setattr(runner, "plan", plan)
    result = app.tasks[b.PLAN_TASK].apply(args=["job"])  # eager: retries at once
    assert result.successful(), result.traceback
    assert calls == ["job"] * 3


@pytest.mark.parametrize(
    "error",
    [RedisConnectionError("Error -3 connecting to redis:6379"), ValueError("a bad footer")],
)
def test_a_plan_that_fails_for_good_ends_the_job_failed(
    batch_app: tuple[Any, Runner, str],
    redis_server: RedisServer,
    monkeypatch: pytest.MonkeyPatch,
    error: Exception,
) -> None:
    app, runner, namespace = batch_app
    keys, batch_id = Keys(namespace), uuid.uuid4().hex
    redis = Redis.from_url(redis_server.url)
    redis.hset(keys.batch(batch_id), mapping={b.F_STATUS: b.PLANNING, b.F_OWNER: "team-a"})

    def plan(batch_id: str, resume: bool) -> None:
        raise error

    monkeypatch.setattr(runner, "plan", plan)
    try:
        result = app.tasks[b.PLAN_TASK].apply(args=[batch_id])  # eager: retries at once
        assert not result.successful()
        record = redis.hgetall(keys.batch(batch_id))
        assert record[b.F_STATUS.encode()] == b.FAILED.encode()
        assert record[b.F_ERROR.encode()].decode() == f"planning failed: {error}"
        member = u.expiry_member(u.BATCH, "team-a", batch_id)
        assert redis.zscore(keys.store_expiry, member) is not None  # it expires
    finally:
        redis.close()
