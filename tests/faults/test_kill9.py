"""``kill -9`` under load of each process ``sluice up`` supervises: it comes back by itself.

Eight clients send requests back to back to the only worker of the slow model, each
request marked and its answer checked; after a second one process is killed with
SIGKILL: (a) the gateway, (b) the model's only worker, (c) the private redis-server that
``sluice up`` started (these stacks run without SLUICE_REDIS_URL). Each time Sluice
answers correctly again by itself (within ANSWER_AGAIN_S of the kill), and every request
ends once: a correct 200, a dropped connection for the requests that were inside the
killed gateway, or (Redis killed) a JSON 503 for the requests the old Redis lost, failed
at once when the gateway sees the new Redis; none past its deadline and none answered
twice.
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from redis import Redis
from redis.exceptions import RedisError

from tests.faults.conftest import (
    FAST_FAILURE_DETECTION,
    MODEL,
    Report,
    exit_statuses,
    signal_a_busy_worker,
)
from tests.support import procs
from tests.support.load import Answer, Load, slow_request
from tests.support.slow_model import write_slow
from tests.support.stack import Stack

CLIENTS = 8
ITERS = 20
ANSWER_AGAIN_S = 15.0
"""The service answers correctly again within this long after the kill: ten times what a
new process takes to start and serve on a quiet machine (about 1.5 s), as a loaded one
took over 5 s."""
DEADLINE_S = ANSWER_AGAIN_S + 5.0
"""Requests' deadline: room for a new worker to take over what the killed one held."""
REDIS_DEADLINE_S = 4.0
"""Short, so that a request left waiting for an entry lost with Redis would show (504)."""
WARM_UP_S = 1.0
"""The load runs this long before the kill, and until a first request was answered: a
busy machine answers the first later (the test measures recovery, not the start)."""
FIRST_ANSWER_S = 60.0
"""The most the first answer may take before the kill."""
AFTER_RECOVERY_S = 1.0


@pytest.fixture
def private_stack(tmp_path: Path) -> Iterator[Stack]:
    """``sluice up`` with its own redis-server (no SLUICE_REDIS_URL), one slow worker."""
    write_slow(tmp_path, MODEL, extra="dynamic_batching { max_queue_delay_microseconds: 1000 }")
    stack = Stack(tmp_path, None, env=FAST_FAILURE_DETECTION)
    try:
        stack.start()
        yield stack
    finally:
        stack.stop()


def classify(answer: Answer, gone_at: float) -> str:
    if answer.correct:
        return "ok"
    if answer.status == 200:
        return "wrong"
    if answer.status is None:
        if answer.error is not None and "Timeout" in answer.error:
            return "hung"
        # Sent on a connection of the killed gateway before its sockets were closed: the
        # connection drops with the process (reset, or closed without a response).
        if answer.started_s < gone_at:
            return "dropped_in_killed_gateway"
        return "connection_error_after_kill"
    if answer.status in (503, 504) and answer.well_formed:
        return str(answer.status)
    return "bad_error"


def under_load(
    stack: Stack, kill: Callable[[], dict[str, Any]], deadline_s: float = DEADLINE_S
) -> dict[str, Any]:
    """Load the stack, ``kill()`` after WARM_UP_S and a first answer, keep the load on until
    Sluice answered correctly again (or ANSWER_AGAIN_S + 5 s passed) and a second more; the
    figures.
    ``kill()`` returns figures of its own, and may return ``killed_at`` (when it sent
    the signal, if it waited for a moment to) and ``gone_at`` (when the killed process
    was gone, its sockets closed)."""
    load = Load(
        stack.url,
        MODEL,
        CLIENTS,
        10**9,
        build=lambda i: slow_request(i, ITERS, timeout_us=int(deadline_s * 1e6)),
        client_timeout_s=deadline_s + 5,
    ).start()
    try:
        time.sleep(WARM_UP_S)
        procs.wait_until(lambda: load.ok_count() > 0, FIRST_ANSWER_S, 0.02)
        ok_before = load.ok_count()
        killed_at = time.monotonic()
        detail = kill()
        killed_at = detail.pop("killed_at", killed_at)
        gone_at = detail.pop("gone_at", killed_at)

        def answered_again() -> float | None:
            ends = [
                a.started_s + a.latency_s
                for a in list(load.answers)
                if a.correct and a.started_s > killed_at
            ]
            return min(ends) - killed_at if ends else None

        procs.wait_until(lambda: answered_again() is not None, ANSWER_AGAIN_S + 5, 0.02)
        time.sleep(AFTER_RECOVERY_S)
    finally:
        load.stop()
    load.join(deadline_s + 10)

    per_index = Counter(a.index for a in load.answers)
    classes = Counter(classify(a, gone_at) for a in load.answers)
    again = answered_again()
    return {
        "sent": load.sent,
        "answered": sum(a.status is not None for a in load.answers),
        "ok_before_kill": ok_before,
        "outcomes": dict(sorted(classes.items())),
        "lost": load.sent - len(load.answers) + classes["hung"],
        "duplicated": sum(n - 1 for n in per_index.values() if n > 1),
        "answered_again_s": None if again is None else round(again, 2),
        "max_latency_s": round(max(a.latency_s for a in load.answers), 2),
        "deadline_s": deadline_s,
        **detail,
    }


def check(figures: dict[str, Any], allowed: set[str]) -> None:
    assert figures["ok_before_kill"] > 0, "nothing was answered before the kill"
    assert figures["answered_again_s"] is not None, "Sluice did not answer again after the kill"
    assert figures["answered_again_s"] <= ANSWER_AGAIN_S, figures
    assert figures["lost"] == 0, figures
    assert figures["duplicated"] == 0, figures
    assert set(figures["outcomes"]) <= allowed, figures
    assert figures["max_latency_s"] < figures["deadline_s"] + 1, "a request outlived its deadline"


@pytest.mark.timeout(120)
def test_killed_gateway_comes_back(private_stack: Stack, report: Report) -> None:
    stack = private_stack
    assert stack.process is not None
    before = procs.gateway_pids(stack.process.pid)
    victim = before[0]

    def kill() -> dict[str, Any]:
        os.kill(victim, signal.SIGKILL)
        # Reaped: all its threads are gone, so are its sockets (a zombie leader is not enough).
        assert procs.wait_until(lambda: not Path(f"/proc/{victim}").exists(), 5, 0.001)
        return {"gone_at": time.monotonic()}

    figures = under_load(stack, kill)
    after = procs.gateway_pids(stack.process.pid)
    report(figures)
    assert victim not in after and len(after) == len(before)
    assert any(
        re.search(r"gateway#\d+ exited with status -9", line) for line in exit_statuses(stack)
    )
    # The new gateway knows the catalog before it accepts what waited in the backlog.
    check(figures, {"ok", "dropped_in_killed_gateway"})


@pytest.mark.timeout(120)
def test_killed_only_worker_comes_back(private_stack: Stack, report: Report) -> None:
    stack = private_stack
    assert stack.process is not None
    assert stack.redis_url is not None
    redis = Redis.from_url(stack.redis_url)
    try:
        (first,) = procs.worker_pids(stack.process.pid)

        def kill() -> dict[str, Any]:
            victim, held = signal_a_busy_worker(redis, stack, signal.SIGKILL)
            assert victim == first
            return {"killed_at": time.monotonic(), "held_by_killed_worker": len(held)}

        figures = under_load(stack, kill)
    finally:
        redis.close()
    report(figures)
    assert procs.worker_pids(stack.process.pid) - {first}, "no new worker"
    check(figures, {"ok"})


@pytest.mark.timeout(120)
def test_killed_private_redis_comes_back(private_stack: Stack, report: Report) -> None:
    stack = private_stack
    assert stack.process is not None
    assert stack.redis_url is not None
    victim = procs.redis_server_pid(stack.process.pid)
    client = Redis.from_url(stack.redis_url, socket_timeout=0.5, socket_connect_timeout=0.5)

    def pong() -> bool:
        try:
            return bool(client.ping())
        except RedisError:
            return False

    def kill() -> dict[str, Any]:
        killed_at = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        back = procs.wait_until(lambda: not procs.alive(victim) and pong(), 10, 0.01)
        return {"redis_back_s": round(time.monotonic() - killed_at, 3) if back else None}

    try:
        figures = under_load(stack, kill, REDIS_DEADLINE_S)
    finally:
        client.close()
    report(figures)
    assert figures["redis_back_s"] is not None, "redis-server did not come back on its port"
    assert procs.redis_server_pid(stack.process.pid) != victim
    check(figures, {"ok", "503"})
