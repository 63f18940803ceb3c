"""A tenant's batch jobs take turns, on a real redis-server (runners of batch workers, a
recording broker of their plan and shard tasks in one FIFO queue as Celery's, tasks run in
turn; jobs submitted as the gateway submits them):

- every job of a tenant could run at once (10,000 jobs of 16 shard tasks each in the batch
  queue, ~160 MB of Redis, and most of the batch workers' turns taken from a tenant with
  one job); now at most ``SLUICE_TENANT_MAX_RUNNING_BATCHES`` run, the others wait
  ``queued`` in line and start in order, each as one of the tenant's running jobs ends;
- another tenant's job starts at once, and ends before the first tenant's waiting ones start;
- a batch worker killed as a job ended (its turn not given on, or given and the next job not
  started), or a plan task lost, does not leave the tenant's line waiting for ever: the
  batch workers' periodic round gives the turn and starts the job;
- a batch worker killed between starting a job (planned, or resumed from the line) and
  listing it among the running jobs does not leave it running with no shard sent: the
  periodic round sends its plan task again once the one taken is old;
- a gateway killed between writing its way into the tenant's turns and writing the job
  leaves an entry the periodic round drops once it is old (and admits while it is young,
  should the job appear ``queued``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from sluice.batch.feeder import Feeder
from sluice.batch.runner import Reaper, Runner
from sluice.core.batch_jobs import batches as b
from sluice.core.batch_jobs import turns
from sluice.core.clock import CLOCK
from sluice.scheduler.executor.redis_server import RedisServer
from tests.unit.batch.runners import make_runner, resumed, written

ACTIVE = (b.PLANNING, b.RUNNING)


class Broker:
    """Plan and shard tasks in one FIFO queue; checks, as each is sent and run, that no
    tenant has more than ``bound`` jobs planning or running."""

    def __init__(self, bound: int) -> None:
        self.bound = bound
        self.queue: list[tuple[str, int]] = []  # (batch id, shard; -1: its plan task)
        self.plans: list[str] = []
        self.runner: Runner | None = None
        self.jobs: dict[str, list[str]] = {}  # tenant -> its jobs, as submitted

    def plan(self, batch_id: str) -> None:
        self.plans.append(batch_id)
        self.queue.append((batch_id, -1))
        self.check()

    def shard(self, batch_id: str, index: int) -> None:
        self.queue.append((batch_id, index))

    def check(self) -> None:
        assert self.runner is not None
        for tenant, jobs in self.jobs.items():
            active = [job for job in jobs if status(self.runner, job) in ACTIVE]
            assert len(active) <= self.bound, f"{tenant}: {len(active)} jobs running"

    def run_one(self) -> tuple[str, int]:
        assert self.runner is not None
        batch_id, index = self.queue.pop(0)
        if index < 0:
            self.runner.plan(batch_id, resume=True)
        else:
            self.runner.shard(batch_id, index, True)
        self.check()
        return batch_id, index

    def drain(self) -> None:
        while self.queue:
            self.run_one()


def status(runner: Runner, batch_id: str) -> str:
    return runner.record(batch_id).get(b.F_STATUS, "")


@pytest.fixture(autouse=True)
def doubling_model(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Feeder, "run", lambda self, inputs: {"Y": inputs["X"] * 2})


@pytest.fixture
def source(tmp_path: Path) -> Path:
    """Three rows, one a shard."""
    path = tmp_path / "rows.npy"
    np.save(path, np.arange(6, dtype=np.float32).reshape(3, 2))
    return path


@pytest.fixture
def worker(
    redis_server: RedisServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Callable[[int], tuple[Runner, Broker]]]:
    made: list[Runner] = []

    def one(bound: int) -> tuple[Runner, Broker]:
        broker = Broker(bound)
        runner = make_runner(
            redis_server,
            tmp_path,
            monkeypatch,
            on_shard=broker.shard,
            on_plan=broker.plan,
            tenant_max_running_batches=bound,
        )
        broker.runner = runner
        made.append(runner)
        return runner, broker

    yield one
    for runner in made:
        runner.close()


def submit(runner: Runner, broker: Broker, tenant: str, source: Path) -> tuple[str, int]:
    """``POST /v2/batches`` as the gateway makes it: the job written ``queued``, then a
    turn of its tenant's (it starts: its plan task) or a place in line; its id and place."""
    options = b.BatchOptions(shard_rows=1, input_format="npy", output_format="npy")
    batch_id = written(runner, source, options, tenant, b.QUEUED)
    keys = runner.keys
    broker.jobs.setdefault(tenant, []).append(batch_id)
    place = runner.turns.admit(tenant, batch_id)
    if place == 0:
        now = f"{CLOCK.now():.3f}"
        _, send = runner.redis.eval(turns.START, 1, keys.batch(batch_id), now, b.RESUME_QUEUED_S)
        if send:
            broker.plan(batch_id)
    return batch_id, place


def test_a_tenant_runs_at_most_its_bound_and_the_rest_start_in_order(
    worker: Callable[[int], tuple[Runner, Broker]], source: Path
) -> None:
    runner, broker = worker(2)
    submitted = [submit(runner, broker, "team-a", source) for _ in range(5)]
    jobs = [batch_id for batch_id, _ in submitted]
    assert [place for _, place in submitted] == [0, 0, 1, 2, 3]
    assert [status(runner, job) for job in jobs] == [b.PLANNING] * 2 + [b.QUEUED] * 3
    assert broker.plans == jobs[:2]

    broker.drain()
    assert broker.plans == jobs  # each started once, in the order they came
    for job in jobs:
        record = runner.record(job)
        assert record[b.F_STATUS] == b.COMPLETED, record
        assert (runner.redis.hgetall(runner.keys.batch_attempts(job))).keys() == {
            b"0",
            b"1",
            b"2",
        }
    started = [float(runner.record(job)[b.F_STARTED]) for job in jobs]
    assert started == sorted(started)
    assert not runner.redis.exists(runner.keys.tenant_running_batches("team-a"))
    assert not runner.redis.exists(runner.keys.tenant_queued_batches("team-a"))
    assert not runner.redis.sismember(runner.keys.batch_turn_tenants, "team-a")


def test_another_tenants_job_is_not_held_back_by_one_tenants_many(
    worker: Callable[[int], tuple[Runner, Broker]], source: Path
) -> None:
    runner, broker = worker(2)
    many = [submit(runner, broker, "team-a", source)[0] for _ in range(6)]
    mine, place = submit(runner, broker, "team-b", source)
    assert place == 0 and status(runner, mine) == b.PLANNING
    while status(runner, mine) != b.COMPLETED:
        batch_id, index = broker.run_one()
        assert (batch_id, index) not in [(job, -1) for job in many[2:]], "B waited behind A"
    # (A's next two got the turns of its first two, their plan tasks behind B's shards)
    assert [status(runner, job) for job in many[2:]] == [b.PLANNING] * 2 + [b.QUEUED] * 2
    broker.drain()
    assert {status(runner, job) for job in many} == {b.COMPLETED}
    assert broker.plans.index(mine) == 2  # right after A's first two


def test_the_periodic_round_fills_the_gap_a_killed_worker_left(
    worker: Callable[[int], tuple[Runner, Broker]],
    source: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    runner, broker = worker(1)
    first, second, third, fourth = (submit(runner, broker, "team-a", source)[0] for _ in range(4))
    assert broker.plans == [first]

    # Killed as the first ended: its turn not given on.
    with monkeypatch.context() as killed:
        killed.setattr(runner.turns, "leave", _killed)
        broker.drain()
    assert status(runner, first) == b.COMPLETED and status(runner, second) == b.QUEUED
    assert broker.plans == [first]
    Reaper(runner).sweep()
    assert broker.plans == [first, second] and status(runner, second) == b.PLANNING

    # Killed after the turn went to the next, before it started.
    with monkeypatch.context() as killed:
        killed.setattr(runner.turns, "start", lambda tenant, batch_ids: None)
        broker.drain()
    assert status(runner, second) == b.COMPLETED and status(runner, third) == b.QUEUED
    assert runner.redis.zscore(runner.keys.tenant_running_batches("team-a"), third) is not None
    Reaper(runner).sweep()
    assert broker.plans[-1] == third and status(runner, third) == b.PLANNING

    # Started, but its plan task lost (the broker refused it, or lost it).
    runner.redis.hset(runner.keys.batch(third), b.F_RESUME_QUEUED, "1")
    broker.queue.clear()
    Reaper(runner).sweep()
    assert broker.plans[-1] == third and broker.queue == [(third, -1)]
    Reaper(runner).sweep()  # (sent again once)
    assert broker.queue == [(third, -1)]

    broker.drain()
    assert {status(runner, job) for job in (first, second, third, fourth)} == {b.COMPLETED}
    assert broker.plans == [first, second, third, third, fourth]


def _killed(*args: object) -> None:
    raise RuntimeError("the batch worker was killed")


def test_a_job_that_ends_as_it_gets_its_turn_gives_the_turn_on(
    worker: Callable[[int], tuple[Runner, Broker]], source: Path
) -> None:
    """Cancelled (or removed) between getting its turn and starting: the next starts."""
    runner, broker = worker(1)
    first, second, third = (submit(runner, broker, "team-a", source)[0] for _ in range(3))
    runner.redis.eval(b.CANCEL, 1, runner.keys.batch(second), "1")  # (no turn given on)
    broker.drain()
    assert status(runner, first) == b.COMPLETED and status(runner, second) == b.CANCELLED
    assert broker.plans == [first, third]
    broker.drain()
    assert status(runner, third) == b.COMPLETED


def _later(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    """The deployment's clock ``seconds`` on from now (as the periodic round reads it)."""
    now = CLOCK.now
    monkeypatch.setattr(CLOCK, "now", lambda: now() + seconds)


@pytest.mark.parametrize("start", ["planned", "resumed"])
def test_a_job_whose_worker_was_killed_before_it_listed_it_running_runs_all_the_same(
    worker: Callable[[int], tuple[Runner, Broker]],
    source: Path,
    monkeypatch: pytest.MonkeyPatch,
    start: str,
) -> None:
    runner, broker = worker(1)
    keys = runner.keys
    batch_id, _ = submit(runner, broker, "team-a", source)
    if start == "resumed":
        # It ran, was cancelled, and is resumed: it takes the free turn and starts (its
        # plan task resumes it).
        broker.run_one()
        runner.redis.eval(b.CANCEL, 1, keys.batch(batch_id), "1")
        runner.redis.srem(keys.running_batches, batch_id)
        runner.turns.leave("team-a", batch_id)
        broker.queue.clear()
        assert resumed(runner, batch_id, "team-a") == 0
        broker.plan(batch_id)
    # Its plan task runs: the job runs, and the worker is killed before it lists it among
    # the running jobs (nor is the task redelivered).
    with monkeypatch.context() as killed:
        killed.setattr(runner.redis, "sadd", _killed)
        with pytest.raises(RuntimeError, match="killed"):
            broker.run_one()
    assert status(runner, batch_id) == b.RUNNING and broker.queue == []
    assert not runner.redis.sismember(keys.running_batches, batch_id)

    Reaper(runner).sweep()  # (a task taken this recently may still be running)
    assert broker.queue == []
    with monkeypatch.context() as later:
        _later(later, b.RESUME_QUEUED_S * 2)
        Reaper(runner).sweep()
        assert broker.queue == [(batch_id, -1)]
        Reaper(runner).sweep()  # (sent again once)
        assert broker.queue == [(batch_id, -1)]
    broker.drain()
    assert status(runner, batch_id) == b.COMPLETED
    assert not runner.redis.exists(keys.tenant_running_batches("team-a"))
    assert b.F_PLAN_TAKEN not in runner.record(batch_id)


def test_a_plan_task_that_runs_leaves_no_mark_and_is_never_sent_again(
    worker: Callable[[int], tuple[Runner, Broker]],
    source: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    runner, broker = worker(1)
    batch_id, _ = submit(runner, broker, "team-a", source)
    broker.run_one()  # (planned: running, its shards sent)
    assert b.F_PLAN_TAKEN not in runner.record(batch_id)
    with monkeypatch.context() as later:
        _later(later, b.RESUME_QUEUED_S * 10)
        Reaper(runner).sweep()  # (its shards, never leased, are sent again; not its plan)
    assert broker.plans == [batch_id] and (batch_id, -1) not in broker.queue
    broker.drain()
    assert status(runner, batch_id) == b.COMPLETED


def test_a_way_in_without_its_job_is_dropped_once_old_and_admitted_once_queued(
    worker: Callable[[int], tuple[Runner, Broker]],
    source: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    runner, broker = worker(1)
    keys = runner.keys
    tenant_keys = turns.tenant_keys(keys, "team-a")
    admitting = keys.tenant_admitting_batches("team-a")
    # A gateway wrote a job's way in, and was killed before it wrote the job.
    never = "0" * 32
    runner.redis.eval(turns.INTEND, 4, *tenant_keys, never, "team-a", f"{CLOCK.now():.3f}")
    Reaper(runner).sweep()  # (young: its gateway may be writing it)
    assert runner.redis.zscore(admitting, never) is not None
    with monkeypatch.context() as later:
        _later(later, turns.ADMITTING_GRACE_S * 2)
        Reaper(runner).sweep()
    assert not runner.redis.exists(admitting)
    assert not runner.redis.sismember(keys.batch_turn_tenants, "team-a")

    # One whose job is written queued is admitted, even young: it starts.
    options = b.BatchOptions(shard_rows=1, input_format="npy", output_format="npy")
    batch_id = written(runner, source, options, "team-a", b.QUEUED)
    runner.redis.eval(turns.INTEND, 4, *tenant_keys, batch_id, "team-a", f"{CLOCK.now():.3f}")
    Reaper(runner).sweep()
    assert status(runner, batch_id) == b.PLANNING and broker.plans == [batch_id]
    assert not runner.redis.exists(admitting)
    broker.drain()
    assert status(runner, batch_id) == b.COMPLETED
