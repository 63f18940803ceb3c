"""Helpers shared by the fault tests: figures, worker victims, Redis look-ups."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from redis import Redis

from sluice.core.keys import WORKER_GROUP, Keys
from tests.support import procs
from tests.support.slow_model import write_slow
from tests.support.stack import Stack

MODEL = "slow"
TWO_WORKERS = (
    "dynamic_batching { max_queue_delay_microseconds: 1000 }\n"
    "instance_group [ { count: 2 kind: KIND_CPU } ]"
)
FAST_FAILURE_DETECTION = {"SLUICE_HEARTBEAT_S": "0.3", "SLUICE_RECLAIM_INTERVAL_S": "0.3"}

Report = Callable[[dict[str, Any]], None]


@pytest.fixture
def report(request: pytest.FixtureRequest, record_property: Callable[[str, Any], None]) -> Report:
    """Print a test's figures (shown with ``pytest -s``) and record them as properties."""

    def emit(figures: dict[str, Any]) -> None:
        print(f"\n[{request.node.name}] {json.dumps(figures, sort_keys=True)}")
        for name, value in figures.items():
            record_property(name, value)

    return emit


@pytest.fixture
def two_workers(
    tmp_path: Path,
    start_stack: Callable[..., Stack],
    redis_of: Callable[[Stack], Redis],
) -> tuple[Stack, Redis]:
    """A stack serving the slow model with two worker processes, both beating, and a
    client on its Redis."""
    write_slow(tmp_path, MODEL, extra=TWO_WORKERS)
    stack = start_stack(tmp_path, env=FAST_FAILURE_DETECTION)
    assert stack.process is not None
    redis = redis_of(stack)
    wait_for_workers(redis, stack, 2)
    return stack, redis


@pytest.fixture
def redis_of(request: pytest.FixtureRequest) -> Iterator[Callable[[Stack], Redis]]:
    """Factory: a Redis client on a stack's Redis, closed at the end."""
    clients: list[Redis] = []

    def open_client(stack: Stack) -> Redis:
        client = Redis.from_url(stack.redis_url)
        clients.append(client)
        return client

    yield open_client
    for client in clients:
        client.close()


def live_workers(redis: Redis, stack: Stack, model: str = MODEL) -> int:
    return int(redis.zcount(Keys(stack.namespace).live_workers(model, 1), time.time(), "+inf"))


def wait_for_workers(redis: Redis, stack: Stack, count: int, timeout_s: float = 30.0) -> None:
    assert procs.wait_until(lambda: live_workers(redis, stack) >= count, timeout_s), (
        f"fewer than {count} live workers after {timeout_s} s"
    )


def held_entries(redis: Redis, stack: Stack, pid: int, model: str = MODEL) -> list[bytes]:
    """Ids of the request entries the worker with this pid holds (read, not acknowledged)."""
    stream = Keys(stack.namespace).request_stream(model, 1)
    held: list[bytes] = []
    for consumer in redis.xinfo_consumers(stream, WORKER_GROUP):
        name = consumer["name"].decode()
        if f"-{pid}-" in name and consumer["pending"]:
            rows = redis.xpending_range(
                stream, WORKER_GROUP, min="-", max="+", count=10_000, consumername=name
            )
            held += [row["message_id"] for row in rows]
    return held


def request_ids(redis: Redis, stack: Stack, entry_ids: list[bytes], model: str = MODEL) -> set[str]:
    """The client request ids (``id`` of the JSON body) of these stream entries."""
    from sluice.core.wire import decode_request

    stream = Keys(stack.namespace).request_stream(model, 1)
    ids = set()
    for entry_id in entry_ids:
        for _, fields in redis.xrange(stream, entry_id, entry_id):
            ids.add(decode_request(fields)[0].client_id)
    return ids


def signal_a_busy_worker(
    redis: Redis, stack: Stack, signum: int, timeout_s: float = 10.0
) -> tuple[int, set[str]]:
    """Send ``signum`` to a worker while it holds requests; returns its pid and the ids of
    the requests it held. The worker is frozen (SIGSTOP) while its holdings are read,
    so what it holds cannot change between the look and the signal."""
    assert stack.process is not None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for pid in sorted(procs.worker_pids(stack.process.pid)):
            try:
                os.kill(pid, signal.SIGSTOP)
            except ProcessLookupError:
                continue
            try:
                held = held_entries(redis, stack, pid)
                if held:
                    ids = request_ids(redis, stack, held)
                    os.kill(pid, signum)
                    return pid, ids
            finally:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
        time.sleep(0.005)
    raise AssertionError(f"no worker held a request within {timeout_s} s")


def taken_over_from(stack: Stack, pid: int) -> int:
    """Requests other workers took over from the worker with this pid (from the logs)."""
    pattern = re.compile(rf"took over (\d+) requests of worker \S*-{pid}-")
    return sum(int(m.group(1)) for line in stack.stderr_lines if (m := pattern.search(line)))


def exit_statuses(stack: Stack) -> list[str]:
    """The supervisor's 'exited with status N' lines."""
    return [line.strip() for line in stack.stderr_lines if "exited with status" in line]


def inference_count(stack: Stack, model: str = MODEL) -> int:
    with httpx.Client(base_url=stack.url, timeout=10) as http:
        stats = http.get(f"/v2/models/{model}/stats").json()
    return int(stats["model_stats"][0]["inference_count"])
