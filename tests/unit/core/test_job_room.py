"""The job scripts' accounting of each tenant's queued jobs (:mod:`sluice.core.jobs`), on a real
Redis: counted in SUBMIT, given back exactly once when the job leaves the queue (started,
answered, cancelled, or its wait over), never drifting; and idempotency keys that tell a
repeated request from another one."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, cast

import pytest
from redis import Redis

from sluice.core import jobs
from sluice.core.keys import Keys
from sluice.scheduler.executor.redis_server import RedisServer

MODEL = "m"
TTL_S = 100


@dataclass
class Jobs:
    """Runs the job scripts as the gateway and the workers do, with a clock of its own."""

    redis: Redis
    keys: Keys = field(default_factory=lambda: Keys(f"t{uuid.uuid4().hex[:8]}"))
    now: float = 1_000.0
    max_jobs: int = 3
    max_bytes: int = 10_000
    max_results: int = 1_000

    @property
    def stream(self) -> str:
        return self.keys.background_stream(MODEL, 1)

    def submit(
        self, tenant: str, size: int = 100, key: str = "", digest: str = "d"
    ) -> tuple[int, str]:
        job_id = jobs.new_job_id()
        job = self.keys.job(MODEL, job_id)
        fields = {b"h": b"x" * (size - 2)}  # 2 bytes of field name
        args: list[Any] = [
            job_id,
            f"{self.now:.6f}",
            60,
            TTL_S,
            100_000,
            MODEL,
            1,
            b"\x90",
            "rid",
            key,
            tenant,
            "",
            digest if key else "",
            self.max_jobs,
            self.max_bytes,
            size,
            self.max_results,
        ]
        for name, value in fields.items():
            args += [name, value]
        keys = [
            job,
            self.stream,
            self.keys.job_by_key(MODEL, tenant, key) if key else job,
            self.keys.stats(MODEL, 1),
            self.keys.queued_jobs(MODEL),
            self.keys.job_room(MODEL),
            self.keys.tenant_streams(MODEL, 1),
            self.stream,
            self.keys.job_results(MODEL),
            self.keys.finished_jobs(MODEL),
        ]
        answer = cast(list[Any], self.redis.eval(jobs.SUBMIT, len(keys), *keys, *args))
        return int(answer[0]), answer[1].decode()

    def start(self, *job_ids: str) -> None:
        keys = [self.keys.queued_jobs(MODEL), self.keys.job_room(MODEL)]
        keys += [self.keys.job(MODEL, job_id) for job_id in job_ids]
        self.redis.eval(jobs.START, len(keys), *keys, f"{self.now:.6f}", *job_ids)

    def finish(
        self, job_id: str, status: str = jobs.COMPLETED, data: bytes = b"", results: bool = True
    ) -> int:
        """``results``: with the result accounts' keys (False: as a worker of an older
        release calls it)."""
        keys = [
            self.keys.job(MODEL, job_id),
            self.keys.stats(MODEL, 1),
            self.keys.queued_jobs(MODEL),
            self.keys.job_room(MODEL),
        ]
        if results:
            keys += [self.keys.job_results(MODEL), self.keys.finished_jobs(MODEL)]
        args = [status, b"", data, f"{self.now:.6f}", "", "", job_id]
        return int(self.redis.eval(jobs.FINISH, len(keys), *keys, *args))  # type: ignore[arg-type]

    def remove(self, job_id: str, key: str = "", tenant: str = "") -> str | None:
        job = self.keys.job(MODEL, job_id)
        keys = [
            job,
            self.keys.job_by_key(MODEL, tenant, key) if key else job,
            self.keys.job_results(MODEL),
            self.keys.finished_jobs(MODEL),
        ]
        status = self.redis.eval(jobs.REMOVE, len(keys), *keys, job_id)
        return cast(bytes, status).decode() if status is not None else None

    def kept(self, tenant: str) -> int:
        """Bytes the answers of the tenant's finished jobs hold."""
        return int(self.redis.hget(self.keys.job_results(MODEL), f"r:{tenant}") or 0)

    def cancel(self, job_id: str) -> str:
        keys = [
            self.keys.job(MODEL, job_id),
            self.stream,
            self.keys.stats(MODEL, 1),
            self.keys.queued_jobs(MODEL),
            self.keys.job_room(MODEL),
        ]
        status = self.redis.eval(jobs.CANCEL, len(keys), *keys, f"{self.now:.6f}", job_id)
        return cast(bytes, status).decode()

    def held(self, tenant: str) -> tuple[int, int]:
        """(jobs, bytes) the tenant's queued jobs hold."""
        room = self.keys.job_room(MODEL)
        count, size = self.redis.hmget(room, [f"n:{tenant}", f"b:{tenant}"])
        return int(count or 0), int(size or 0)

    def empty(self) -> bool:
        """Nothing left of the accounting: no key lingers once every job left the queue."""
        room, queued = self.keys.job_room(MODEL), self.keys.queued_jobs(MODEL)
        return not self.redis.exists(room) and not self.redis.exists(queued)


@pytest.fixture
def redis(redis_server: RedisServer) -> Iterator[Redis]:
    client = Redis.from_url(redis_server.url)
    yield client
    client.close()


@pytest.fixture
def js(redis: Redis) -> Jobs:
    return Jobs(redis)


def test_a_tenant_is_bounded_in_queued_jobs_and_another_is_not(js: Jobs) -> None:
    ids = [js.submit("a") for _ in range(3)]
    assert all(outcome == 1 for outcome, _ in ids)
    assert js.held("a") == (3, 300)
    assert js.submit("a") == (-2, "3")
    assert js.submit("b")[0] == 1
    assert js.held("a") == (3, 300) and js.held("b") == (1, 100)
    assert js.redis.xlen(js.stream) == 4  # the refused one added nothing


def test_a_tenant_is_bounded_in_queued_bytes(js: Jobs) -> None:
    assert js.submit("a", size=6_000)[0] == 1
    assert js.submit("a", size=4_001) == (-4, "6000")
    assert js.submit("a", size=4_000)[0] == 1
    assert js.held("a") == (2, 10_000)
    assert js.submit("b", size=10_000)[0] == 1


def test_each_way_out_of_the_queue_gives_the_room_back_once(js: Jobs) -> None:
    (_, started), (_, answered), (_, cancelled) = (js.submit("a") for _ in range(3))
    js.start(started)
    assert js.held("a") == (2, 200)
    assert js.finish(started) == 1  # answered after it started: nothing more to give back
    assert js.held("a") == (2, 200)
    assert js.finish(answered, jobs.EXPIRED) == 1  # answered while queued (expired)
    assert js.held("a") == (1, 100)
    assert js.cancel(cancelled) == "cancelled"
    assert js.held("a") == (0, 0)
    js.start(started, answered, cancelled)  # late or repeated: nothing changes
    assert js.finish(answered) == 0 and js.cancel(cancelled) == "cancelled"
    assert js.held("a") == (0, 0) and js.empty()
    assert all(js.submit("a")[0] == 1 for _ in range(3))


def test_a_job_being_computed_when_cancelled_has_given_its_room_back(js: Jobs) -> None:
    _, job_id = js.submit("a")
    js.start(job_id)
    assert js.cancel(job_id) == "cancelling"
    assert js.held("a") == (0, 0)
    assert js.finish(job_id) == 1
    assert js.redis.hget(js.keys.job(MODEL, job_id), "status") == b"cancelled"
    assert js.empty()


def test_jobs_whose_wait_ended_unanswered_stop_counting(js: Jobs) -> None:
    for _ in range(3):
        assert js.submit("a")[0] == 1
    js.now += TTL_S / 2
    assert js.submit("a")[0] == -2
    js.now += TTL_S / 2 + 0.001  # the first three waited their whole queue ttl
    outcome, late = js.submit("a")
    assert outcome == 1 and js.held("a") == (1, 100)
    assert js.redis.zcard(js.keys.queued_jobs(MODEL)) == 1
    js.start(late)
    assert js.empty()


def test_the_accounting_expires_with_the_longest_wait(js: Jobs) -> None:
    js.submit("a")
    for key in (js.keys.job_room(MODEL), js.keys.queued_jobs(MODEL)):
        assert 0 < js.redis.ttl(key) <= TTL_S + 60


def test_an_idempotency_key_is_the_tenants_and_bound_to_its_request(js: Jobs) -> None:
    outcome, first = js.submit("a", key="1", digest="body-1")
    assert outcome == 1
    assert js.submit("a", key="1", digest="body-1") == (0, first)
    assert js.submit("a", key="1", digest="body-2") == (-3, first)
    outcome, other = js.submit("b", key="1", digest="body-1")
    assert outcome == 1 and other != first
    assert js.held("a") == (1, 100)  # neither the repeat nor the conflict added anything


def test_a_key_stored_before_digests_existed_still_finds_its_job(js: Jobs) -> None:
    js.redis.set(js.keys.job_by_key(MODEL, "a", "old"), "f" * 32)
    assert js.submit("a", key="old", digest="anything") == (0, "f" * 32)


def test_a_tenants_kept_answers_are_bounded_and_given_back_when_deleted_or_gone(
    js: Jobs,
) -> None:
    """Retention 60 s (see :meth:`Jobs.submit`): the answers of a's finished jobs are counted
    as they are written; at its limit a's next job is refused, b's is not; deleting a
    finished job, or its retention passing, gives its bytes back."""
    js.max_results = 1_000
    (_, first), (_, second) = js.submit("a"), js.submit("a")
    assert js.finish(first, data=b"x" * 600) == 1 and js.finish(second, data=b"x" * 500) == 1
    assert js.kept("a") >= 1_100
    assert js.submit("a")[0] == -5
    assert js.submit("b")[0] == 1
    assert js.remove(first) == "completed"
    assert not js.redis.exists(js.keys.job(MODEL, first))
    assert 500 <= js.kept("a") < 1_000
    assert js.remove(first) is None  # gone: nothing more to give back
    outcome, third = js.submit("a")
    assert outcome == 1
    js.finish(third, data=b"x" * 600)
    assert js.submit("a")[0] == -5
    for key in (js.keys.job_results(MODEL), js.keys.finished_jobs(MODEL)):
        assert 0 < js.redis.ttl(key) <= 60 + 60  # they outlive the answers they count
    js.now += 61  # both answers' retention ended: the next submission stops counting them
    assert js.submit("a")[0] == 1 and js.kept("a") == 0
    assert not js.redis.exists(js.keys.job_results(MODEL))  # nothing lingers


def test_answers_of_jobs_queued_under_the_limit_are_not_kept_past_it(js: Jobs) -> None:
    """Jobs a tenant queued while its kept answers were under its limit are answered
    later: once the answers kept reach the limit, the next one is not kept (the job fails
    with a 429 naming it); they used to be kept all, each submission having passed the
    check, so that a tenant with 10,000 jobs queued could keep 10,000 answers."""
    js.max_results = 1_000
    first, second, third = (js.submit("a")[1] for _ in range(3))
    _, others = js.submit("b")
    assert js.finish(first, data=b"x" * 600) == 1
    assert js.finish(second, data=b"x" * 600) == 1  # (under the limit when it came)
    kept = js.kept("a")
    assert js.finish(third, data=b"x" * 600) == 1
    record = cast(dict[bytes, bytes], js.redis.hgetall(js.keys.job(MODEL, third)))
    assert record[b"status"] == b"failed" and record[b"error_kind"] == b"QuotaExceeded"
    assert record[b"data"] == b"" and record[b"reply"] == b""
    error = record[b"error"].decode()
    assert "SLUICE_TENANT_MAX_JOB_RESULT_BYTES=1000" in error and "tenant 'a'" in error
    assert js.kept("a") == kept + len(error)  # the error alone is kept
    assert js.finish(others, data=b"x" * 600) == 1  # another tenant's answer is kept
    assert js.redis.hget(js.keys.job(MODEL, others), "status") == b"completed"
    js.now += 61  # their retention over, a's answers no longer count...
    first, second, third = (js.submit("a")[1] for _ in range(3))
    assert js.finish(first, data=b"x" * 600) == 1 and js.finish(second, data=b"x" * 600) == 1
    js.now += 61  # ... nor when they end before a job queued with them is answered
    assert js.finish(third, data=b"x" * 600) == 1
    assert js.redis.hget(js.keys.job(MODEL, third), "status") == b"completed"
    assert js.kept("a") >= 600


def test_removing_leaves_unfinished_jobs_and_takes_the_idempotency_key(js: Jobs) -> None:
    _, waiting = js.submit("a")
    assert js.remove(waiting) == "queued"
    assert js.redis.exists(js.keys.job(MODEL, waiting))
    outcome, keyed = js.submit("a", key="k", digest="d1")
    assert outcome == 1 and js.finish(keyed) == 1
    assert js.remove(keyed, key="k", tenant="a") == "completed"
    assert not js.redis.exists(js.keys.job_by_key(MODEL, "a", "k"))
    assert js.submit("a", key="k", digest="d2")[0] == 1  # the key is free again


def test_an_answer_written_by_an_older_worker_counts_nothing_and_still_finishes(
    js: Jobs,
) -> None:
    _, job_id = js.submit("a")
    assert js.finish(job_id, data=b"x" * 5_000, results=False) == 1
    assert js.redis.hget(js.keys.job(MODEL, job_id), "status") == b"completed"
    assert js.kept("a") == 0
