"""Fair share between tenants over a real stack (two API keys, a slow model).

Tenant A queues many requests; tenant B's few requests, sent after, are answered before A's
backlog is done (the order of completion, not timing). A worker killed while it holds a
tenant's entries: they are taken over from the tenant's stream and answered. /metrics shows
each tenant's queue time.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import orjson
import pytest
from redis import Redis

from sluice.core.keys import WORKER_GROUP, Keys
from tests.support import procs
from tests.support.load import slow_request
from tests.support.slow_model import write_slow
from tests.support.stack import Stack

KEY_A, KEY_B = "key-of-team-a", "key-of-team-b"
KEYS = {"SLUICE_API_KEYS": f"team-a:{KEY_A},team-b:{KEY_B}"}
ONE_AT_A_TIME = "instance_group [ { count: 1 kind: KIND_CPU } ]"
TWO_WORKERS = (
    "dynamic_batching { max_queue_delay_microseconds: 1000 }\n"
    "instance_group [ { count: 2 kind: KIND_CPU } ]"
)


def per_iteration_s(stack: Stack) -> float:
    """Seconds one iteration of the slow model takes here (one request of many)."""
    with httpx.Client(base_url=stack.url, timeout=60) as http:
        durations = []
        for _ in range(2):  # the first also pays the session's warm-up
            started = time.monotonic()
            response = http.post(
                "/v2/models/slow/infer",
                content=orjson.dumps(slow_request(0, 20_000)),
                headers={"Authorization": f"Bearer {KEY_A}"},
            )
            assert response.status_code == 200, response.text
            durations.append(time.monotonic() - started)
    return max(min(durations), 0.001) / 20_000


def sender(
    stack: Stack, finished: list[str], lock: threading.Lock
) -> Callable[[str, str, int, int], threading.Thread]:
    def send(name: str, key: str, index: int, iters: int) -> None:
        with httpx.Client(base_url=stack.url, timeout=120) as http:
            response = http.post(
                "/v2/models/slow/infer",
                content=orjson.dumps(slow_request(index, iters)),
                headers={"Authorization": f"Bearer {key}"},
            )
        assert response.status_code == 200, response.text
        with lock:
            finished.append(name)

    def start(name: str, key: str, index: int, iters: int) -> threading.Thread:
        thread = threading.Thread(target=send, args=(name, key, index, iters))
        thread.start()
        return thread

    return start


@pytest.mark.timeout(180)
def test_a_tenants_few_requests_pass_another_tenants_backlog(
    tmp_path: Path, start_stack: Callable[..., Stack]
) -> None:
    write_slow(tmp_path, "slow", max_batch_size=1, extra=ONE_AT_A_TIME)
    stack = start_stack(tmp_path, env=KEYS)
    iters = max(1, int(0.15 / per_iteration_s(stack)))  # about 0.15 s a request
    finished: list[str] = []
    start = sender(stack, finished, threading.Lock())

    assert stack.redis_url is not None
    redis, keys = Redis.from_url(stack.redis_url), Keys(stack.namespace)

    def queued() -> int:
        tenants = [m.decode() for m in redis.smembers(keys.tenant_streams("slow", 1))]
        return sum(redis.xlen(s) for s in [*keys.request_streams("slow", 1, 0), *tenants])

    # B has asked before, so the worker knows its stream (a new tenant's is found within a
    # refresh, :data:`sluice.workers.intake.TENANTS_REFRESH_S`): this is about the turns.
    with httpx.Client(base_url=stack.url, timeout=60) as http:
        answer = http.post(
            "/v2/models/slow/infer",
            content=orjson.dumps(slow_request(98, 1)),
            headers={"Authorization": f"Bearer {KEY_B}"},
        )
        assert answer.status_code == 200, answer.text
    # A long request of A's holds the only worker, so A's backlog cannot drain before it is
    # seen queued, however fast or slow this machine is today.
    holder = start("holder", KEY_A, 99, iters * 20)
    assert procs.wait_until(lambda: queued() >= 1, 20), queued()
    threads = [start(f"a{index}", KEY_A, index, iters) for index in range(12)]
    # A's backlog (about 1.8 s of work) is queued: B comes behind all of it.
    assert procs.wait_until(lambda: queued() >= 12, 30), queued()
    redis.close()
    threads += [start(f"b{index}", KEY_B, 100 + index, iters) for index in range(3)]
    for thread in [holder, *threads]:
        thread.join(150)
    finished.remove("holder")
    assert sorted(finished) == sorted([f"a{i}" for i in range(12)] + ["b0", "b1", "b2"])
    last_b = max(finished.index(f"b{i}") for i in range(3))
    # First come, first served would answer B last (position 14); shared, B's three take
    # turns with A's: at least four of A's requests are still to come after them.
    assert last_b <= 10, finished

    with httpx.Client(base_url=stack.url, timeout=30) as http:
        text = http.get("/metrics", headers={"Authorization": f"Bearer {KEY_B}"}).text
    counts = {
        match.group(1): float(match.group(2))
        for match in re.finditer(
            r'sluice_tenant_queue_duration_seconds_count\{[^}]*tenant="([^"]+)"[^}]*\} (\S+)', text
        )
    }
    assert counts.get("team-b") == 4, counts
    assert counts.get("team-a", 0) >= 12, counts


def held_by(redis: Redis, stream: str, pid: int) -> int:
    """Entries of ``stream`` the worker with this pid holds (read, not acknowledged)."""
    with contextlib.suppress(Exception):
        for consumer in redis.xinfo_consumers(stream, WORKER_GROUP):
            if f"-{pid}-" in consumer["name"].decode():
                return int(consumer["pending"])
    return 0


@pytest.mark.timeout(180)
def test_a_killed_workers_tenant_entries_are_taken_over_and_answered(
    tmp_path: Path, start_stack: Callable[..., Stack]
) -> None:
    write_slow(tmp_path, "slow", max_batch_size=1, extra=TWO_WORKERS)
    stack = start_stack(
        tmp_path, env={**KEYS, "SLUICE_HEARTBEAT_S": "0.3", "SLUICE_RECLAIM_INTERVAL_S": "0.3"}
    )
    assert stack.process is not None
    iters = max(1, int(0.3 / per_iteration_s(stack)))
    finished: list[str] = []
    start = sender(stack, finished, threading.Lock())
    threads = [start(f"a{index}", KEY_A, index, iters) for index in range(10)]
    stream = Keys(stack.namespace).request_stream("slow", 1, 0, "team-a")
    assert stack.redis_url is not None
    redis = Redis.from_url(stack.redis_url)
    victim = 0
    deadline = time.monotonic() + 20
    while not victim and time.monotonic() < deadline:
        for pid in sorted(procs.worker_pids(stack.process.pid)):
            os.kill(pid, signal.SIGSTOP)  # (what it holds cannot change while we look)
            try:
                if held_by(redis, stream, pid):
                    os.kill(pid, signal.SIGKILL)
                    victim = pid
                    break
            finally:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
        time.sleep(0.005)
    assert victim, "no worker held an entry of the tenant's stream"
    for thread in threads:
        thread.join(150)
    assert sorted(finished) == sorted(f"a{i}" for i in range(10))
    taken = re.compile(rf"took over (\d+) requests of worker \S*-{victim}-\S* from (\S+)")
    assert procs.wait_until(
        lambda: any(
            (m := taken.search(line)) and m.group(2) == stream for line in stack.stderr_lines
        ),
        10,
    ), [line for line in stack.stderr_lines if "took over" in line or "Traceback" in line][:5]
    redis.close()
