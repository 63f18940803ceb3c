"""A batch's planning that meets Redis (or its name) out of reach for a moment is tried
again rather than left `planning` for good."""

from __future__ import annotations

from pathlib import Path

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from sluice.batch.app import create_app
from sluice.core.batch_jobs import batches as b
from sluice.core.settings import BatchSettings


def test_a_plan_that_meets_redis_away_is_tried_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SLUICE_BATCH_STORE", str(tmp_path))
    app, runner = create_app(BatchSettings())
    calls: list[str] = []

    def plan(batch_id: str, resume: bool) -> None:
        calls.append(batch_id)
        if len(calls) < 3:
            raise RedisConnectionError("Error -3 connecting to redis:6379. Temporary failure")

    monkeypatch.setattr(runner, "plan", plan)
    try:
        result = app.tasks[b.PLAN_TASK].apply(args=["job"])  # eager: retries at once
        assert result.successful(), result.traceback
        assert calls == ["job"] * 3
    finally:
        runner.close()
