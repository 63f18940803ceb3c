"""A batch job cancelled while a batch worker plans it stays cancelled.

The planner reads the record (``planning``), opens the input and counts its rows, then
starts the job. A cancel that lands in between used to be overwritten by the planner's
``running``: the client had its 200 ``cancelled`` and the job ran to the end anyway."""

from __future__ import annotations

import orjson
import pytest
from redis import Redis

from sluice.batch.runner import Runner
from sluice.core.batch_jobs import batches as b
from sluice.core.keys import Keys
from sluice.core.settings import BatchSettings
from sluice.scheduler.executor.redis_server import RedisServer

NAMESPACE = "cancel-race"
BATCH = "c" * 32


class _Rows:
    rows = 10
    row_bytes = 0


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


@pytest.mark.parametrize("cancelled", [True, False])
def test_a_cancel_while_the_outputs_are_written_up_is_never_undone(
    redis_server: RedisServer, planning: Redis, monkeypatch: pytest.MonkeyPatch, cancelled: bool
) -> None:
    """The last shard committed, the runner writes the manifest; a cancel that lands then
    used to be overwritten by ``completed`` (the client had its 200 ``cancelled``, and then
    found the job completed)."""
    keys = Keys(NAMESPACE)
    planning.hset(keys.batch(BATCH), b.F_STATUS, b.RUNNING)
    planning.sadd(keys.running_batches, BATCH)
    runner = _runner(redis_server, [], monkeypatch)

    def manifest(batch_id: str, record: dict[str, str]) -> tuple[str, list[object]]:
        if cancelled:
            planning.hset(keys.batch(BATCH), b.F_STATUS, b.CANCELLED)
        return "_manifest.json", []

    monkeypatch.setattr(runner, "_manifest", manifest)
    try:
        runner._finish(BATCH)
    finally:
        runner.close()
    record = _record(planning)
    ended = b.CANCELLED if cancelled else b.COMPLETED
    assert record[b.F_STATUS.encode()] == ended.encode()
    assert (b.F_MANIFEST.encode() in record) is not cancelled
    if not cancelled:
        assert not planning.sismember(keys.running_batches, BATCH)


def test_a_job_cancelled_with_every_shard_done_ends_when_resumed(
    redis_server: RedisServer, planning: Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its shards are all committed, so none is sent again: resuming it writes its outputs
    up (it stayed ``running`` for ever)."""
    keys = Keys(NAMESPACE)
    planning.hset(keys.batch(BATCH), mapping={b.F_STATUS: b.RUNNING, b.F_SHARDS: 2})
    planning.hset(keys.batch_shards(BATCH), mapping={0: '{"committed": 1}', 1: '{"committed": 1}'})
    sent: list[int] = []
    runner = _runner(redis_server, sent, monkeypatch)
    monkeypatch.setattr(runner, "_manifest", lambda batch_id, record: ("_manifest.json", []))
    try:
        runner.plan(BATCH, resume=True)
    finally:
        runner.close()
    assert sent == []
    assert _record(planning)[b.F_STATUS.encode()] == b.COMPLETED.encode()
