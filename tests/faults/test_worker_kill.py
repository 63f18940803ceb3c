"""A worker killed (SIGKILL) under sustained load: nothing lost, nothing answered twice.

Issue 4. Two workers serve one model; 16 client threads send 3000 requests back to
back, each with a unique marker; after about a second one worker is killed while it
holds requests. The other worker takes them over once the dead one's heartbeat
expires, and the supervisor starts a new worker.
"""

from __future__ import annotations

import signal
import time

import pytest
from redis import Redis

from tests.faults.conftest import (
    MODEL,
    Report,
    exit_statuses,
    inference_count,
    signal_a_busy_worker,
    taken_over_from,
)
from tests.support import procs
from tests.support.load import Load, slow_request
from tests.support.stack import Stack

REQUESTS = 3000
CLIENTS = 16


@pytest.mark.timeout(180)
def test_killed_worker_loses_nothing(two_workers: tuple[Stack, Redis], report: Report) -> None:
    stack, redis = two_workers
    assert stack.process is not None
    workers_before = procs.worker_pids(stack.process.pid)
    assert len(workers_before) == 2

    load = Load(
        stack.url, MODEL, CLIENTS, REQUESTS, build=lambda i: slow_request(i, iters=20)
    ).start()
    time.sleep(1.0)
    sent_at_kill = load.sent
    victim, held = signal_a_busy_worker(redis, stack, signal.SIGKILL)
    killed_at = time.monotonic()

    assert procs.wait_until(lambda: not procs.alive(victim), 5)
    replaced = procs.wait_until(
        lambda: (
            len(procs.worker_pids(stack.process.pid) - workers_before) == 1
            and len(procs.worker_pids(stack.process.pid)) == 2
        ),
        10,
    )
    restart_s = time.monotonic() - killed_at
    load.join(150)
    procs.wait_until(lambda: taken_over_from(stack, victim) >= len(held), 5)

    figures = load.figures()
    ok_ids = {f"req-{a.index}" for a in load.answers if a.correct}
    computed = inference_count(stack)
    figures.update(
        sent_before_kill=sent_at_kill,
        held_by_killed_worker=len(held),
        held_answered_ok=len(held & ok_ids),
        taken_over_by_others=taken_over_from(stack, victim),
        worker_replaced_after_s=round(restart_s, 2),
        inference_count=computed,
        gateway_rss_mb=round(max(map(procs.rss_mb, procs.gateway_pids(stack.process.pid))), 1),
    )
    report(figures)

    assert replaced, f"no new worker after the kill; supervisor said {exit_statuses(stack)}"
    assert any("status -9" in line for line in exit_statuses(stack))
    assert figures["sent"] == REQUESTS
    assert figures["lost"] == 0, [a for a in load.answers if a.status is None][:5]
    assert figures["answered"] == REQUESTS
    assert figures["duplicated"] == 0
    assert figures["wrong_answers"] == 0
    assert figures["malformed_errors"] == 0
    # The dead worker's requests go to the other worker long before their 60 s deadline.
    assert figures["errors_by_status"] == {}, [a for a in load.answers if not a.correct][:5]
    assert figures["ok"] == REQUESTS
    assert held and held <= ok_ids, "a request the killed worker held was not answered"
    assert figures["taken_over_by_others"] >= len(held)
    assert computed >= figures["ok"]
