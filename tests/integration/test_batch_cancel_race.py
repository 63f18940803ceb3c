"""A batch job cancelled while a batch worker plans it stays cancelled.

The planner reads the record (``planning``), opens the input and counts its rows, then
starts the job. A cancel that lands in between used to be overwritten by the planner's
``running``: the client had its 200 ``cancelled`` and the job ran to the end anyway."""

from __future__ import annotations

import orjson
import pytest
from redis import Redis

from sluice.batch.runner import Runner
from sluice.core import batches as b
from sluice.core.keys import Keys
from sluice.core.settings import BatchSettings
from sluice.scheduler.executor.redis_server import RedisServer

NAMESPACE = "cancel-race"
BATCH = "c" * 32


class _Rows:
    rows = 10


def _record(redis: Redis) -> dict[bytes, bytes]:
    return redis.hgetall(Keys(NAMESPACE).batch(BATCH))  # type: ignore[return-value]


@pytest.fixture
def planning(redis_server: RedisServer) -> Redis:
    redis = Redis.from_url(redis_server.url)
    redis.hset(
        Keys(NAMESPACE).batch(BATCH),
        mapping={
            b.F_STATUS: b.PLANNING,
            b.F_MODEL: "mlp",
            b.F_INPUT: "upload:" + "u" * 32,
            b.F_OPTIONS: orjson.dumps(b.BatchOptions().to_json()),
            b.F_OWNER: "team-a",
        },
    )
    return redis


def _runner(redis_server: RedisServer, sent: list[int], monkeypatch: pytest.MonkeyPatch) -> Runner:
    runner = Runner(
        BatchSettings(redis_url=redis_server.url, namespace=NAMESPACE),
        lambda _batch, index: sent.append(index),
    )
    monkeypatch.setattr(runner, "_model", lambda record: (object(), 1))
    monkeypatch.setattr(runner, "_outputs", lambda batch_id, record: None)
    monkeypatch.setattr("sluice.batch.runner._check_output_format", lambda *_: None)
    return runner


def test_a_cancel_during_planning_is_never_undone(
    redis_server: RedisServer, planning: Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    sent: list[int] = []
    runner = _runner(redis_server, sent, monkeypatch)

    def cancel_meanwhile(*_: object) -> _Rows:
        planning.hset(Keys(NAMESPACE).batch(BATCH), b.F_STATUS, b.CANCELLED)
        return _Rows()

    monkeypatch.setattr(runner, "_reader", cancel_meanwhile)
    try:
        runner.plan(BATCH, resume=False)
    finally:
        runner.close()
    record = _record(planning)
    assert record[b.F_STATUS.encode()] == b.CANCELLED.encode()
    assert b.F_SHARDS.encode() not in record
    assert sent == []
    assert not planning.sismember(Keys(NAMESPACE).running_batches, BATCH)


def test_an_uncancelled_job_starts_with_its_shards(
    redis_server: RedisServer, planning: Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    sent: list[int] = []
    runner = _runner(redis_server, sent, monkeypatch)
    monkeypatch.setattr(runner, "_reader", lambda *_: _Rows())
    try:
        runner.plan(BATCH, resume=False)
    finally:
        runner.close()
    record = _record(planning)
    assert record[b.F_STATUS.encode()] == b.RUNNING.encode()
    assert int(record[b.F_SHARDS.encode()]) == 1 and sent == [0]
    assert planning.sismember(Keys(NAMESPACE).running_batches, BATCH)
