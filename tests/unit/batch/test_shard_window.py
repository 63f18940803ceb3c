"""A running batch job keeps a bounded window of shard tasks in the queue, on a real
redis-server (the runner, a recording ``send_shard`` as the broker, shards run in turn):

- planning sent one task per shard at once (up to 100,000 a job, about a kilobyte of Redis
  each), so one tenant could fill Redis to its high-water mark (every tenant's online
  requests refused) and take the whole batch queue ahead of other tenants' jobs; now at most
  ``SLUICE_BATCH_SHARDS_IN_FLIGHT`` shards of a job are sent and not ended at once, and the
  next is sent as one ends, every shard exactly once;
- two batch workers whose shards end at once never send the same next shard, nor skip one;
- a batch worker killed between a shard's commit and sending the next, or a message the
  broker refused or lost, does not leave the job short: the periodic round tops it up;
- the reaper still queues again a shard whose worker died, within the window;
- resume sends the lost shards within the window and the cursor carries on; cancel stops
  sending; a job planned before the window (every shard queued, no cursor) still finishes."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from sluice.batch.feeder import Feeder, ShardFailed
from sluice.batch.runner import Reaper, Runner
from sluice.core.batch_jobs import batches as b
from sluice.core.clock import CLOCK
from sluice.scheduler.executor.redis_server import RedisServer
from tests.unit.batch.runners import TENANT, make_runner, planned, resumed

ROWS = 40


class Broker:
    """The shard tasks runners send, in a FIFO queue as Celery's; checks, as each is sent,
    that the job has at most ``window`` shards sent and not ended."""

    def __init__(self, window: int) -> None:
        self.window = window
        self.queue: list[tuple[str, int]] = []
        self.sent: list[int] = []
        self.most_outstanding = 0
        self.runner: Runner | None = None
        self._lock = threading.Lock()

    def send(self, batch_id: str, index: int) -> None:
        with self._lock:
            self.queue.append((batch_id, index))
            self.sent.append(index)
            sent = set(self.sent)
        if self.runner is not None:
            outstanding = len(sent - ended(self.runner, batch_id))
            self.most_outstanding = max(self.most_outstanding, outstanding)
            assert outstanding <= self.window, f"{outstanding} shards sent and not ended"

    def pop(self) -> tuple[str, int] | None:
        with self._lock:
            return self.queue.pop(0) if self.queue else None


def ended(runner: Runner, batch_id: str) -> set[int]:
    """The shards of ``batch_id`` committed or failed for good."""
    states = runner.redis.hgetall(runner.keys.batch_shards(batch_id))
    return {int(k) for k, v in states.items() if b'"committed"' in v or b'"error"' in v}


@pytest.fixture(autouse=True)
def doubling_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every request is answered Y = 2 X."""
    monkeypatch.setattr(Feeder, "run", lambda self, inputs: {"Y": inputs["X"] * 2})


@pytest.fixture
def runners(
    redis_server: RedisServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Callable[..., tuple[Runner, Broker]]]:
    made: list[Runner] = []

    def runner(
        window: int, namespace: str = "", broker: Broker | None = None
    ) -> tuple[Runner, Broker]:
        broker = broker or Broker(window)
        one = make_runner(
            redis_server,
            tmp_path,
            monkeypatch,
            on_shard=broker.send,
            namespace=namespace,
            batch_shards_in_flight=window,
        )
        broker.runner = broker.runner or one
        made.append(one)
        return one, broker

    yield runner
    for one in made:
        one.close()


def _job(runner: Runner, tmp_path: Path, rows: int = ROWS) -> str:
    """A job of ``rows`` rows in shards of one row; its id."""
    source = tmp_path / "rows.npy"
    np.save(source, np.arange(rows * 2, dtype=np.float32).reshape(rows, 2))
    return planned(
        runner, source, b.BatchOptions(shard_rows=1, input_format="npy", output_format="npy")
    )


def _drain(runner: Runner, broker: Broker) -> list[int]:
    """Run the queued shard tasks in turn until none is left; the shards run."""
    ran: list[int] = []
    while (message := broker.pop()) is not None:
        assert len(broker.queue) < broker.window
        runner.shard(*message, True)
        ran.append(message[1])
    return ran


def _completed(
    runner: Runner, batch_id: str, tmp_path: Path, rows: int = ROWS, retried: str = ""
) -> None:
    record = runner.record(batch_id)
    assert record[b.F_STATUS] == b.COMPLETED, record
    assert record[b.F_SHARDS_DONE] == str(rows)
    joined = np.load(tmp_path / "store" / TENANT / "batches" / batch_id / "Y.npy")
    assert (joined == np.arange(rows * 2, dtype=np.float32).reshape(rows, 2) * 2).all()
    attempts = runner.redis.hgetall(runner.keys.batch_attempts(batch_id))
    attempts.pop(retried.encode(), None)
    assert set(attempts.values()) == {b"1"}  # (every shard ran once)


def _in_flight(runner: Runner, batch_id: str) -> set[int]:
    return {int(k) for k in runner.redis.hkeys(runner.keys.batch_in_flight(batch_id))}


def test_a_job_of_many_shards_keeps_its_window_and_runs_every_shard_once(
    runners: Callable[..., tuple[Runner, Broker]], tmp_path: Path
) -> None:
    runner, broker = runners(4)
    batch_id = _job(runner, tmp_path)
    assert broker.queue == [(batch_id, index) for index in range(4)]
    assert _in_flight(runner, batch_id) == {0, 1, 2, 3}

    assert _drain(runner, broker) == list(range(ROWS))
    assert broker.sent == list(range(ROWS)) and broker.most_outstanding == 4
    _completed(runner, batch_id, tmp_path)
    assert _in_flight(runner, batch_id) == set()


def test_two_workers_ending_shards_at_once_send_each_next_shard_once(
    runners: Callable[..., tuple[Runner, Broker]], tmp_path: Path
) -> None:
    first, broker = runners(6)
    second, _ = runners(6, namespace=first.settings.namespace, broker=broker)
    batch_id = _job(first, tmp_path)
    errors: list[BaseException] = []

    def work(runner: Runner) -> None:
        deadline = time.monotonic() + 60
        try:
            while runner.record(batch_id)[b.F_STATUS] == b.RUNNING:
                assert time.monotonic() < deadline, "the job did not end"
                message = broker.pop()
                if message is None:
                    time.sleep(0.005)
                else:
                    runner.shard(*message, True)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(runner,)) for runner in (first, second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert sorted(broker.sent) == list(range(ROWS))  # each once, none skipped
    _completed(first, batch_id, tmp_path)


def test_windows_topped_up_at_once_by_many_workers_send_each_shard_once(
    runners: Callable[..., tuple[Runner, Broker]], tmp_path: Path
) -> None:
    runner, broker = runners(4)
    batch_id = _job(runner, tmp_path)
    shards = runner.keys.batch_shards(batch_id)
    for index in range(4):  # (the first four committed, by workers that died then)
        runner.redis.hset(shards, str(index), '{"committed": true}')
    start = threading.Barrier(8)

    def top_up() -> None:
        start.wait()
        runner.send_next(batch_id)

    threads = [threading.Thread(target=top_up) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert broker.sent == list(range(8))
    assert _in_flight(runner, batch_id) == {4, 5, 6, 7}


def test_a_worker_killed_after_a_commit_leaves_a_window_the_periodic_round_tops_up(
    runners: Callable[..., tuple[Runner, Broker]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    runner, broker = runners(3)
    batch_id = _job(runner, tmp_path, rows=9)
    with monkeypatch.context() as killed:
        killed.setattr(runner, "send_next", lambda batch_id: 0)  # (gone before it sends)
        for _ in range(2):
            message = broker.pop()
            assert message is not None
            runner.shard(*message, True)
    assert broker.queue == [(batch_id, 2)]

    Reaper(runner).sweep()  # the batch workers' periodic round
    assert broker.queue == [(batch_id, 2), (batch_id, 3), (batch_id, 4)]
    assert _drain(runner, broker) == list(range(2, 9))
    _completed(runner, batch_id, tmp_path, rows=9)


def test_a_shard_whose_message_never_came_is_sent_again_by_the_periodic_round(
    runners: Callable[..., tuple[Runner, Broker]],
    tmp_path: Path,
) -> None:
    runner, broker = runners(2)
    refused: list[int] = []

    def refuse_shard_1(batch_id: str, index: int) -> None:
        if index == 1 and not refused:
            refused.append(index)
            raise ConnectionError("the broker is out of reach")
        broker.send(batch_id, index)

    runner.send_shard = refuse_shard_1
    batch_id = _job(runner, tmp_path, rows=6)  # (planned all the same)
    assert broker.queue == [(batch_id, 0)]
    Reaper(runner).sweep()  # refused: sent again at once
    assert broker.queue == [(batch_id, 0), (batch_id, 1)]

    # Sent, but the worker that sent it died before its message was in the queue: sent
    # again once the broker's visibility timeout has passed.
    broker.queue.clear()
    Reaper(runner).sweep()
    assert broker.queue == []
    in_flight = runner.keys.batch_in_flight(batch_id)
    long_ago = CLOCK.now() - runner.settings.batch_visibility_timeout_s - 1
    runner.redis.hset(in_flight, mapping={"0": long_ago, "1": long_ago})
    Reaper(runner).sweep()
    assert sorted(broker.queue) == [(batch_id, 0), (batch_id, 1)]
    _drain(runner, broker)
    _completed(runner, batch_id, tmp_path, rows=6)


def test_the_reaper_queues_again_a_shard_whose_worker_died_within_the_window(
    runners: Callable[..., tuple[Runner, Broker]], tmp_path: Path
) -> None:
    runner, broker = runners(2)
    batch_id = _job(runner, tmp_path, rows=6)
    assert broker.pop() == (batch_id, 0)
    assert runner._take(batch_id, 0) == 1  # its worker takes it, then dies
    runner.redis.hset(runner.keys.batch_leases(batch_id), "0", CLOCK.now() - 60)

    Reaper(runner).sweep()
    assert broker.queue == [(batch_id, 1), (batch_id, 0)]
    Reaper(runner).sweep()  # (once per attempt; the window is full)
    assert broker.queue == [(batch_id, 1), (batch_id, 0)]
    _drain(runner, broker)
    _completed(runner, batch_id, tmp_path, rows=6, retried="0")
    assert runner.redis.hget(runner.keys.batch_attempts(batch_id), "0") == b"2"


def _resume(runner: Runner, batch_id: str) -> None:
    """``POST /v2/batches/{id}/resume`` and its plan task."""
    assert resumed(runner, batch_id) == 0
    runner.plan(batch_id, resume=True)


def test_cancel_stops_sending_and_resume_sends_the_lost_shards_then_carries_on(
    runners: Callable[..., tuple[Runner, Broker]], tmp_path: Path
) -> None:
    runner, broker = runners(2)
    batch_id = _job(runner, tmp_path, rows=6)
    assert _drain_one(runner, broker) == 0  # 1 and 2 queued
    runner.redis.eval(b.CANCEL, 1, runner.keys.batch(batch_id), "1")
    assert _drain(runner, broker) == [1, 2]  # (they do nothing: the job is cancelled)
    Reaper(runner).sweep()
    runner.send_next(batch_id)
    assert broker.sent == [0, 1, 2]

    _resume(runner, batch_id)
    assert broker.queue == [(batch_id, 1), (batch_id, 2)]
    assert _drain(runner, broker) == [1, 2, 3, 4, 5]
    _completed(runner, batch_id, tmp_path, rows=6)


def _drain_one(runner: Runner, broker: Broker) -> int:
    message = broker.pop()
    assert message is not None
    runner.shard(*message, True)
    return message[1]


def test_resume_sends_failed_shards_within_the_window(
    runners: Callable[..., tuple[Runner, Broker]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    runner, broker = runners(2)
    with monkeypatch.context() as failing:

        def odd_rows_fail(self: Feeder, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
            if int(inputs["X"][0, 0]) % 4 == 2:
                raise ShardFailed("the model failed")
            return {"Y": inputs["X"] * 2}

        failing.setattr(Feeder, "run", odd_rows_fail)
        batch_id = _job(runner, tmp_path, rows=8)
        assert _drain(runner, broker) == list(range(8))
    assert runner.record(batch_id)[b.F_STATUS] == b.FAILED
    assert ended(runner, batch_id) == set(range(8))

    broker.sent.clear()
    monkeypatch.setattr("sluice.batch.runner._PASSED_AT_ONCE", 1)  # (a call passes one)
    _resume(runner, batch_id)
    assert broker.queue == [(batch_id, 1), (batch_id, 3)]  # the window: 5 and 7 later
    assert _drain(runner, broker) == [1, 3, 5, 7]
    record = runner.record(batch_id)
    assert record[b.F_STATUS] == b.COMPLETED, record
    assert record[b.F_SHARDS_DONE] == "8"


def test_a_job_planned_before_the_window_finishes(
    runners: Callable[..., tuple[Runner, Broker]], tmp_path: Path
) -> None:
    runner, broker = runners(16)
    batch_id = _job(runner, tmp_path, rows=10)  # every shard queued, as planning did
    runner.redis.hdel(runner.keys.batch(batch_id), b.F_NEXT_SHARD)
    runner.redis.delete(runner.keys.batch_in_flight(batch_id))
    assert len(broker.queue) == 10

    Reaper(runner).sweep()
    assert _drain(runner, broker) == list(range(10))
    assert broker.sent == list(range(10))  # nothing sent again
    _completed(runner, batch_id, tmp_path, rows=10)
