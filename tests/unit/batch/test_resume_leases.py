"""A batch worker's resume and the shard leases, on a real redis-server:

- an attempt stopped by a cancel gives up its shard's lease, so that a resume (which sends
  again only the shards no live lease holds) sends that shard at once, rather than leave it
  to the reaper once the lease has run out;
- ``options.input_name`` is checked again when the job runs: a model whose inputs changed
  since the job was accepted fails it, naming the input and the model's inputs."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sluice.batch.feeder import Cancelled
from sluice.batch.runner import Runner
from sluice.core.batch_jobs import batches as b
from sluice.scheduler.executor.redis_server import RedisServer
from tests.unit.batch.runners import make_runner, planned, resumed


@pytest.fixture
def sent() -> list[tuple[str, int]]:
    """The shards the runner queues, as it queues them."""
    return []


@pytest.fixture
def runner(
    redis_server: RedisServer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    sent: list[tuple[str, int]],
) -> Iterator[Runner]:
    made = make_runner(
        redis_server, tmp_path, monkeypatch, on_shard=lambda *shard: sent.append(shard)
    )
    yield made
    made.close()


def _rows(tmp_path: Path, rows: int) -> Path:
    source = tmp_path / "rows.npy"
    np.save(source, np.zeros((rows, 3), np.float32))
    return source


def test_a_shard_cancelled_mid_way_is_sent_again_by_the_resume(
    runner: Runner, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sent: list[tuple[str, int]]
) -> None:
    batch_id = planned(
        runner,
        _rows(tmp_path, 8),
        b.BatchOptions(shard_rows=4, input_format="npy", output_format="npy"),
    )
    key = runner.keys.batch(batch_id)

    def cancelled_mid_way(*args: Any) -> None:
        runner.redis.eval(b.CANCEL, 1, key, "1")  # as POST .../cancel does
        raise Cancelled(f"batch {batch_id} stopped")

    monkeypatch.setattr(runner, "_run", cancelled_mid_way)
    runner.shard(batch_id, 0, True)
    assert runner.redis.hget(runner.keys.batch_leases(batch_id), "0") is None

    sent.clear()  # (what planning queued)
    assert resumed(runner, batch_id) == 0
    runner.plan(batch_id, resume=True)
    assert sent == [(batch_id, 0), (batch_id, 1)]


def test_an_input_name_the_model_lost_since_submission_fails_the_job_when_it_runs(
    runner: Runner, tmp_path: Path
) -> None:
    options = b.BatchOptions(input_format="npy", output_format="npy", input_name="GONE")
    record = runner.record(planned(runner, _rows(tmp_path, 4), options))
    assert record[b.F_STATUS] == b.FAILED
    assert "model 'm' has no input 'GONE' (inputs: X)" in record[b.F_ERROR]
