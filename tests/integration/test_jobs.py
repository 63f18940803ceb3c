"""Asynchronous jobs against a running stack: ``Prefer: respond-async`` answers 202 and a job
URL; the result is the synchronous answer (tritonclient parses its binary form); failed,
cancelled and expired jobs say so; a repeated idempotency key returns the same job; a job
outlives a restart of the gateway that took it; another API key cannot see it; and online
requests overtake queued jobs."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import httpx
import numpy as np
import pytest
import tritonclient.http as httpclient
from redis import Redis

from sluice.client import Client, QuotaExceeded
from sluice.scheduler.executor.redis_server import RedisServer
from tests.support.load import slow_request
from tests.support.model_files import write_double_and_broken
from tests.support.procs import gateway_pids, wait_until
from tests.support.slow_model import write_slow
from tests.support.stack import Stack

ASYNC = {"Prefer": "respond-async"}
REQUEST = {"id": "", "inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [1, 2]}]}


def write_repository(root: Path) -> None:
    write_double_and_broken(root)
    write_slow(root, "slow", max_batch_size=1)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("jobs")
    write_repository(root)
    stack = Stack(root, redis_server.url)
    stack.start()
    yield stack
    stack.stop()


@pytest.fixture
def http(stack: Stack) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=stack.url, timeout=60) as client:
        yield client


def submit(http: httpx.Client, model: str, body: Any, **headers: str) -> httpx.Response:
    return http.post(f"/v2/models/{model}/infer", json=body, headers={**ASYNC, **headers})


def finished(http: httpx.Client, location: str) -> dict[str, Any]:
    """The job once it has finished (long-polling its result)."""
    assert wait_until(
        lambda: (
            http.get(location).json()["status"] in ("completed", "failed", "expired", "cancelled")
        ),
        60,
        0.1,
    )
    status: dict[str, Any] = http.get(location).json()
    return status


def test_a_job_answers_202_and_its_result_is_the_synchronous_answer(http: httpx.Client) -> None:
    answer = submit(http, "double", {**REQUEST, "id": "first"})
    assert answer.status_code == 202, answer.text
    location = answer.headers["location"]
    assert location.startswith("/v2/jobs/")
    assert answer.headers["preference-applied"] == "respond-async"
    assert answer.json()["status"] in ("queued", "in_progress", "completed")
    result = http.get(f"{location}/result", headers={"Prefer": "wait=30"})
    assert result.status_code == 200, result.text
    sync = http.post("/v2/models/double/infer", json={**REQUEST, "id": "first"})
    assert result.json() == sync.json()
    status = http.get(location).json()
    assert status["status"] == "completed" and status["model"] == "double"
    assert {"created", "started", "finished"} <= set(status)


def test_tritonclient_parses_a_binary_job_result(http: httpx.Client) -> None:
    features = np.array([[1.5, -2.0], [3.0, 4.25]], dtype=np.float32)
    inp = httpclient.InferInput("x", list(features.shape), "FP32")
    inp.set_data_from_numpy(features, binary_data=True)
    out = httpclient.InferRequestedOutput("y", binary_data=True)
    body, json_length = httpclient.InferenceServerClient.generate_request_body([inp], [out])
    headers = {**ASYNC, "Content-Type": "application/octet-stream"}
    if json_length is not None:
        headers["Inference-Header-Content-Length"] = str(json_length)
    answer = http.post("/v2/models/double/infer", content=body, headers=headers)
    assert answer.status_code == 202, answer.text
    result = http.get(f"{answer.headers['location']}/result", headers={"Prefer": "wait=30"})
    assert result.status_code == 200, result.text
    length = result.headers.get("inference-header-content-length")
    parsed = httpclient.InferenceServerClient.parse_response_body(
        result.content, header_length=int(length) if length else None
    )
    np.testing.assert_array_equal(parsed.as_numpy("y"), features * 2)


def test_bad_input_is_refused_at_submission_as_a_synchronous_request_is(
    http: httpx.Client,
) -> None:
    bad = {"inputs": [{"name": "x", "shape": [1, 3], "datatype": "FP32", "data": [1, 2, 3]}]}
    job, sync = submit(http, "double", bad), http.post("/v2/models/double/infer", json=bad)
    assert job.status_code == sync.status_code == 400
    assert job.json() == sync.json()
    assert submit(http, "nope", REQUEST).status_code == 404


def test_a_job_the_model_fails_is_failed_with_the_reason(http: httpx.Client) -> None:
    answer = submit(http, "broken", REQUEST)
    assert answer.status_code == 202
    status = finished(http, answer.headers["location"])
    assert status["status"] == "failed"
    assert "this model is broken" in status["error"]
    result = http.get(f"{answer.headers['location']}/result")
    sync = http.post("/v2/models/broken/infer", json=REQUEST)
    assert result.status_code == sync.status_code == 500
    assert "this model is broken" in result.json()["error"]


def test_a_queued_job_is_cancelled_and_a_late_one_expires(http: httpx.Client) -> None:
    blocker = submit(http, "slow", slow_request(1, 300_000))  # busy for seconds
    assert blocker.status_code == 202
    assert wait_until(
        lambda: http.get(blocker.headers["location"]).json()["status"] != "queued", 30
    )
    queued = submit(http, "slow", slow_request(2, 10))
    late = submit(http, "slow", slow_request(3, 10, timeout_us=1000))
    cancelled = http.delete(queued.headers["location"])
    assert cancelled.status_code == 200, cancelled.text
    assert cancelled.json()["status"] == "cancelled"
    gone = http.get(f"{queued.headers['location']}/result")
    assert gone.status_code == 410 and "cancelled" in gone.json()["error"]
    assert http.delete(blocker.headers["location"]).json()["status"] in ("cancelling", "cancelled")
    assert finished(http, blocker.headers["location"])["status"] == "cancelled"
    assert finished(http, late.headers["location"])["status"] == "expired"
    assert http.get(f"{late.headers['location']}/result").status_code == 504


def test_an_idempotency_key_or_request_id_returns_the_same_job(http: httpx.Client) -> None:
    first = submit(http, "double", REQUEST, **{"Idempotency-Key": "order-42"})
    again = submit(http, "double", REQUEST, **{"Idempotency-Key": "order-42"})
    assert first.headers["location"] == again.headers["location"]
    by_id = submit(http, "double", {**REQUEST, "id": "req-77"})
    by_id_again = submit(http, "double", {**REQUEST, "id": "req-77"})
    assert by_id.headers["location"] == by_id_again.headers["location"]
    other = submit(http, "double", REQUEST, **{"Idempotency-Key": "order-43"})
    assert other.headers["location"] != first.headers["location"]
    bad = submit(http, "double", REQUEST, **{"Idempotency-Key": "has space"})
    assert bad.status_code == 400 and "idempotency key" in bad.json()["error"]


def test_unknown_and_malformed_job_ids_are_not_found(http: httpx.Client) -> None:
    for job_id in ("0" * 32, "../../etc/passwd", "x" * 5000, "ABCDEF" * 6):
        for method, suffix in (("GET", ""), ("GET", "/result"), ("DELETE", "")):
            answer = http.request(method, f"/v2/jobs/{job_id}{suffix}")
            assert answer.status_code == 404, (job_id, method, suffix, answer.text)


def test_a_job_survives_a_restart_of_its_gateway(stack: Stack, http: httpx.Client) -> None:
    assert stack.process is not None
    blocker = submit(http, "slow", slow_request(10, 100_000))
    job = submit(http, "slow", slow_request(11, 10))
    assert job.status_code == 202
    os.kill(gateway_pids(stack.process.pid)[0], signal.SIGKILL)
    time.sleep(0.5)
    assert wait_until(lambda: _ok(http, "/v2/health/live"), 30)
    result = http.get(f"{job.headers['location']}/result", headers={"Prefer": "wait=60"})
    assert result.status_code == 200, result.text
    assert result.json()["outputs"][0]["data"] == [11.0, 11.5, -11.0, 7.0]
    assert http.get(blocker.headers["location"]).json()["status"] == "completed"


def _ok(http: httpx.Client, path: str) -> bool:
    try:
        return http.get(path).status_code == 200
    except httpx.HTTPError:
        return False


def test_online_requests_overtake_queued_jobs(http: httpx.Client) -> None:
    jobs = [submit(http, "slow", slow_request(20 + i, 30_000)) for i in range(8)]
    assert all(job.status_code == 202 for job in jobs)
    started = time.monotonic()
    online = http.post("/v2/models/slow/infer", json=slow_request(99, 10))
    online_s = time.monotonic() - started
    assert online.status_code == 200
    statuses = [http.get(job.headers["location"]).json()["status"] for job in jobs]
    assert statuses.count("completed") < len(jobs), (online_s, statuses)
    for job in jobs:
        assert finished(http, job.headers["location"])["status"] == "completed"


def test_a_job_belongs_to_the_key_that_submitted_it(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    write_repository(tmp_path)
    keyed = Stack(tmp_path, redis_server.url, env={"SLUICE_API_KEYS": "key-a,key-b"})
    keyed.start()
    try:
        with httpx.Client(base_url=keyed.url, timeout=30) as http:
            a, b = {"Authorization": "Bearer key-a"}, {"Authorization": "Bearer key-b"}
            job = submit(http, "double", REQUEST, **a)
            assert job.status_code == 202, job.text
            location = job.headers["location"]
            assert http.get(location, headers=a).status_code == 200
            assert http.get(location, headers=b).status_code == 404
            assert http.get(f"{location}/result", headers=b).status_code == 404
            assert http.delete(location, headers=b).status_code == 404
            assert http.get(location).status_code == 401
            result = http.get(f"{location}/result", headers={**a, "Prefer": "wait=30"})
            assert result.status_code == 200
    finally:
        keyed.stop()


def test_jobs_are_counted_in_the_metrics(http: httpx.Client) -> None:
    answer = submit(http, "double", REQUEST)
    finished(http, answer.headers["location"])
    text = http.get("/metrics").text
    lines = [line for line in text.splitlines() if line.startswith("sluice_jobs_total{")]
    completed = [
        line for line in lines if 'model="double"' in line and 'outcome="completed"' in line
    ]
    assert completed and float(completed[0].rsplit(" ", 1)[1]) >= 1, lines


def test_many_jobs_at_once_all_complete(http: httpx.Client) -> None:
    locations: list[str] = []
    lock = threading.Lock()

    def send(index: int) -> None:
        body = {"inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [index, 1]}]}
        answer = submit(http, "double", body)
        with lock:
            locations.append(answer.headers["location"])

    threads = [threading.Thread(target=send, args=(i,)) for i in range(50)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert len(set(locations)) == 50
    for location in locations:
        result = http.get(f"{location}/result", headers={"Prefer": "wait=30"})
        assert result.status_code == 200


def test_an_idempotency_key_reused_for_another_request_is_a_conflict(http: httpx.Client) -> None:
    tensor = {"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [3, 4]}
    other = {"id": "", "inputs": [tensor]}
    first = submit(http, "double", REQUEST, **{"Idempotency-Key": "order-77"})
    assert first.status_code == 202, first.text
    again = submit(http, "double", REQUEST, **{"Idempotency-Key": "order-77"})
    assert again.status_code == 202 and again.headers["location"] == first.headers["location"]
    conflict = submit(http, "double", other, **{"Idempotency-Key": "order-77"})
    assert conflict.status_code == 409, conflict.text
    assert conflict.json()["error"] == "idempotency key 'order-77' was used for another request"
    by_id = submit(http, "double", {**REQUEST, "id": "req-conflict"})
    assert by_id.status_code == 202
    by_id_other = submit(http, "double", {**other, "id": "req-conflict"})
    assert by_id_other.status_code == 409
    assert "idempotency key 'req-conflict'" in by_id_other.json()["error"]
    assert submit(http, "double", {**REQUEST, "id": "req-conflict"}).status_code == 202
    result = http.get(f"{first.headers['location']}/result", headers={"Prefer": "wait=30"})
    assert result.json()["outputs"][0]["data"] == [2.0, 4.0]  # the first request's answer


TEAM_A = {"Authorization": "Bearer key-a"}
TEAM_B = {"Authorization": "Bearer key-b"}
TEAM_C = {"Authorization": "Bearer key-c"}
TENANT_MAX_JOBS = 3
TENANT_MAX_BYTES = 4_000


@pytest.fixture(scope="module")
def tenants(tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer) -> Iterator[Stack]:
    """A stack with three tenants, an admin, and small per-tenant bounds on queued jobs."""
    root = tmp_path_factory.mktemp("tenants")
    write_repository(root)
    env = {
        "SLUICE_API_KEYS": "team-a:key-a,team-b:key-b,team-c:key-c",
        "SLUICE_ADMIN_KEYS": "admin-key",
        "SLUICE_TENANT_MAX_QUEUED_JOBS": str(TENANT_MAX_JOBS),
        "SLUICE_TENANT_MAX_QUEUED_JOB_BYTES": str(TENANT_MAX_BYTES),
    }
    stack = Stack(root, redis_server.url, env=env)
    stack.start()
    yield stack
    stack.stop()


def test_two_tenants_share_no_job_and_no_idempotency_key(tenants: Stack) -> None:
    wrong, admin = {"Authorization": "Bearer nope"}, {"Authorization": "Bearer admin-key"}
    with httpx.Client(base_url=tenants.url, timeout=60) as http:
        blocker = submit(http, "slow", slow_request(1, 100_000), **TEAM_B)
        assert blocker.status_code == 202, blocker.text
        a = submit(http, "slow", slow_request(2, 10), **TEAM_A, **{"Idempotency-Key": "1"})
        assert a.status_code == 202, a.text
        location = a.headers["location"]
        job_id, unknown = location.rsplit("/", 1)[1], "0" * 32
        for method, suffix in (("GET", ""), ("GET", "/result"), ("DELETE", "")):
            for job in (job_id, unknown):
                path = f"/v2/jobs/{job}{suffix}"
                for headers in (wrong, {}):
                    answer = http.request(method, path, headers=headers)
                    assert answer.status_code == 401, (method, path, answer.text)
                # B learns nothing: A's job answers exactly as an unknown id does
                answer = http.request(method, path, headers=TEAM_B)
                assert answer.status_code == 404, (method, path, answer.text)
                assert answer.json() == {"error": f"no job '{job}'"}
        for headers in (wrong, {}):
            assert submit(http, "slow", slow_request(3, 10), **headers).status_code == 401
        # A's idempotency key, and A's request id, reused by B are B's own new jobs
        b = submit(http, "slow", slow_request(2, 10), **TEAM_B, **{"Idempotency-Key": "1"})
        b_by_id = submit(http, "slow", slow_request(2, 10), **TEAM_B)
        assert b.status_code == b_by_id.status_code == 202, (b.text, b_by_id.text)
        assert len({location, b.headers["location"], b_by_id.headers["location"]}) == 3
        assert http.delete(b.headers["location"], headers=TEAM_B).status_code in (200, 202)
        # nothing B did touched A's job
        assert http.get(location, headers=TEAM_A).json()["status"] in ("queued", "in_progress")
        again = submit(http, "slow", slow_request(2, 10), **TEAM_A, **{"Idempotency-Key": "1"})
        assert again.headers["location"] == location
        result = http.get(f"{location}/result", headers={**TEAM_A, "Prefer": "wait=60"})
        assert result.status_code == 200, result.text
        assert result.json()["outputs"][0]["data"] == [2.0, 2.5, -2.0, 7.0]
        assert http.get(location, headers=admin).status_code == 404  # the admin is a tenant too
        # (queued behind a long job of B's, so that its cancel finds it waiting however
        # fast or slow the machine is: a finished job would be deleted instead)
        hold = submit(http, "slow", slow_request(5, 100_000), **TEAM_B)
        assert wait_until(
            lambda: http.get(hold.headers["location"], headers=TEAM_B).json()["status"] != "queued",
            30,
        )
        cancelled = submit(http, "slow", slow_request(4, 50_000), **TEAM_A)
        assert http.delete(cancelled.headers["location"], headers=TEAM_A).status_code in (200, 202)
        assert finished_as(http, cancelled.headers["location"], TEAM_A) == "cancelled"
        http.delete(hold.headers["location"], headers=TEAM_B)
        assert finished_as(http, b_by_id.headers["location"], TEAM_B) == "completed"
        assert http.get(location, headers=TEAM_A).json()["status"] == "completed"


def finished_as(http: httpx.Client, location: str, headers: dict[str, str]) -> str:
    """The job's status once it has finished."""
    done = ("completed", "failed", "expired", "cancelled")
    assert wait_until(lambda: http.get(location, headers=headers).json()["status"] in done, 60)
    status: str = http.get(location, headers=headers).json()["status"]
    return status


def test_a_tenant_past_its_queued_job_bounds_gets_429_and_another_goes_on(
    tenants: Stack,
) -> None:
    with httpx.Client(base_url=tenants.url, timeout=60) as http:
        blocker = submit(http, "slow", slow_request(30, 600_000), **TEAM_B)
        assert wait_until(
            lambda: (
                http.get(blocker.headers["location"], headers=TEAM_B).json()["status"] != "queued"
            ),
            30,
        )
        queued = [submit(http, "slow", slow_request(31 + i, 10), **TEAM_A) for i in range(3)]
        assert [q.status_code for q in queued] == [202] * 3, [q.text for q in queued]
        refused = submit(http, "slow", slow_request(34, 10), **TEAM_A)
        assert refused.status_code == 429, refused.text
        assert int(refused.headers["retry-after"]) > 0
        assert "SLUICE_TENANT_MAX_QUEUED_JOBS" in refused.json()["error"]
        assert "team-a" in refused.json()["error"]
        # another tenant is not affected; a cancelled job frees its room at once
        assert submit(http, "slow", slow_request(35, 10), **TEAM_B).status_code == 202
        cancel = http.delete(queued[0].headers["location"], headers=TEAM_A)
        assert cancel.json()["status"] == "cancelled"
        assert submit(http, "slow", slow_request(34, 10), **TEAM_A).status_code == 202
        assert submit(http, "slow", slow_request(36, 10), **TEAM_A).status_code == 429
        # bytes: C's jobs are large, so C runs out of bytes before jobs
        big = [submit(http, "slow", big_request(40 + i), **TEAM_C) for i in range(3)]
        assert big[0].status_code == 202, big[0].text
        over = [answer for answer in big if answer.status_code != 202]
        assert over and over[0].status_code == 429, [answer.text for answer in big]
        assert "SLUICE_TENANT_MAX_QUEUED_JOB_BYTES" in over[0].json()["error"]
        too_big = submit(http, "slow", big_request(50, 5_000), **TEAM_C)
        assert too_big.status_code == 413, too_big.text
        assert "SLUICE_TENANT_MAX_QUEUED_JOB_BYTES" in too_big.json()["error"]
        # completed jobs free their room too
        http.delete(blocker.headers["location"], headers=TEAM_B)
        held = [(q, TEAM_A) for q in queued[1:]] + [(b, TEAM_C) for b in big]
        for answer, headers in held:
            if answer.status_code == 202:
                finished_as(http, answer.headers["location"], headers)
        assert wait_until(
            lambda: submit(http, "slow", big_request(60), **TEAM_C).status_code == 202, 30
        )


def big_request(index: int, size: int = 1_500) -> dict[str, Any]:
    """A slow request whose queue entry is large: a request parameter of ``size`` characters
    (such parameters travel on to the model, in the entry)."""
    return {**slow_request(index, 10), "parameters": {"note": "x" * size}}


def test_a_nearly_full_redis_refuses_new_work_until_it_drains(tmp_path: Path) -> None:
    """Redis with a small maxmemory (noeviction): filled past the high-water mark, jobs and
    synchronous requests get 503 with Retry-After; what was accepted before still completes;
    once Redis drains, requests are accepted again."""
    write_repository(tmp_path)
    server = RedisServer()
    server.start()
    stack = Stack(tmp_path, server.url)
    redis = Redis.from_url(server.url)
    try:
        stack.start()
        with httpx.Client(base_url=stack.url, timeout=60) as http:
            accepted = submit(http, "slow", slow_request(1, 100_000))
            assert accepted.status_code == 202, accepted.text
            limit = int(cast(dict[str, Any], redis.info("memory"))["used_memory"]) + (32 << 20)
            redis.config_set("maxmemory-policy", "noeviction")
            redis.config_set("maxmemory", limit)
            while int(cast(dict[str, Any], redis.info("memory"))["used_memory"]) < 0.9 * limit:
                redis.rpush("ballast", b"\0" * (256 << 10))

            def refused() -> bool:
                return submit(http, "double", REQUEST).status_code == 503

            # (The gateway reads Redis's memory at its refresh: 2 s apart when idle.)
            assert wait_until(refused, 30, 0.1)
            job = submit(http, "double", REQUEST)
            sync = http.post("/v2/models/double/infer", json=REQUEST)
            for answer in (job, sync):
                assert answer.status_code == 503, answer.text
                assert int(answer.headers["retry-after"]) > 0
                # the share moves as Redis frees and adds its own bookkeeping; it stays at or
                # above the default high-water mark (85 %) while the ballast is there
                full = re.fullmatch(
                    r"Redis is (\d+)% full \(its maxmemory\); retry later", answer.json()["error"]
                )
                assert full and int(full[1]) >= 85, answer.text
            assert http.get(accepted.headers["location"]).status_code == 200
            redis.delete("ballast")
            assert wait_until(lambda: submit(http, "double", REQUEST).status_code == 202, 30, 0.1)
            assert http.post("/v2/models/double/infer", json=REQUEST).status_code == 200
            result = http.get(
                f"{accepted.headers['location']}/result", headers={"Prefer": "wait=60"}
            )
            assert result.status_code == 200, result.text
            assert result.json()["outputs"][0]["data"] == [1.0, 1.5, -1.0, 7.0]
    finally:
        redis.close()
        stack.stop()
        server.stop()


RETENTION_S = 5


@pytest.fixture
def kept_answers(tmp_path: Path, redis_server: RedisServer) -> Iterator[Stack]:
    """Two tenants, each of whom may keep one answer of finished jobs per model at a time
    (any answer reaches a limit of one byte), kept RETENTION_S."""
    write_repository(tmp_path)
    env = {
        "SLUICE_API_KEYS": "team-a:key-a,team-b:key-b",
        "SLUICE_TENANT_MAX_JOB_RESULT_BYTES": "1",
        "SLUICE_JOB_RETENTION_S": str(RETENTION_S),
    }
    stack = Stack(tmp_path, redis_server.url, env=env)
    stack.start()
    yield stack
    stack.stop()


def test_a_tenants_kept_answers_are_bounded_and_freed_by_deleting_or_expiring(
    kept_answers: Stack,
) -> None:
    """One tenant's finished jobs cannot fill Redis for everyone: once its kept answers
    reach its limit, its new jobs get 429 naming it (another tenant's do not); deleting a
    finished job frees its answer at once, and so does the end of its retention."""
    with httpx.Client(base_url=kept_answers.url, timeout=60) as http:
        first = submit(http, "double", REQUEST, **TEAM_A)
        assert first.status_code == 202, first.text
        assert finished_as(http, first.headers["location"], TEAM_A) == "completed"
        refused = submit(http, "double", REQUEST, **TEAM_A)
        assert refused.status_code == 429, refused.text
        assert "SLUICE_TENANT_MAX_JOB_RESULT_BYTES" in refused.json()["error"]
        assert "team-a" in refused.json()["error"] and int(refused.headers["retry-after"]) > 0
        assert submit(http, "double", REQUEST, **TEAM_B).status_code == 202
        # Another tenant cannot delete it; its owner can, and it is gone.
        assert http.delete(first.headers["location"], headers=TEAM_B).status_code == 404
        deleted = http.delete(first.headers["location"], headers=TEAM_A)
        assert deleted.status_code == 200 and deleted.json()["status"] == "completed"
        assert http.get(first.headers["location"], headers=TEAM_A).status_code == 404
        second = submit(http, "double", REQUEST, **TEAM_A)
        assert second.status_code == 202, second.text
        assert finished_as(http, second.headers["location"], TEAM_A) == "completed"
        assert submit(http, "double", REQUEST, **TEAM_A).status_code == 429
        # Its retention over, the answer no longer counts.
        assert wait_until(
            lambda: submit(http, "double", REQUEST, **TEAM_A).status_code == 202,
            RETENTION_S * 4,
            0.5,
        )


def test_an_answer_not_kept_is_a_final_429_without_retry_after(kept_answers: Stack) -> None:
    """Two jobs queued while the tenant keeps no answer: the one answered second finds the
    limit reached, its answer is not kept and it fails. Reading its result answers the 429
    naming the limit, without Retry-After: the job is over, and every read answers the
    same. It used to say ``Retry-After: 1``, and the Python client retried it."""
    with httpx.Client(base_url=kept_answers.url, timeout=60) as http:
        locations = []
        for index, iters in ((21, 20_000), (22, 0)):  # (the first takes a while)
            queued = submit(http, "slow", slow_request(index, iters), **TEAM_A)
            assert queued.status_code == 202, queued.text
            locations.append(queued.headers["location"])
        ends = {finished_as(http, location, TEAM_A): location for location in locations}
        assert sorted(ends) == ["completed", "failed"], ends
        failed = ends["failed"]
        status = http.get(failed, headers=TEAM_A).json()
        assert "SLUICE_TENANT_MAX_JOB_RESULT_BYTES=1" in status["error"], status
        for prefer in ({}, {"Prefer": "wait=5"}):
            result = http.get(f"{failed}/result", headers={**TEAM_A, **prefer})
            assert result.status_code == 429, result.text
            assert "retry-after" not in result.headers
            assert result.json()["error"] == status["error"]
            assert "team-a" in result.json()["error"]
    job_id = failed.rsplit("/", 1)[1]
    limit = "SLUICE_TENANT_MAX_JOB_RESULT_BYTES"
    with (
        Client(kept_answers.url, api_key="key-a") as client,
        pytest.raises(QuotaExceeded, match=limit) as info,
    ):
        client.wait_job(job_id, timeout_s=30)
    assert info.value.retry_after_s is None
