"""Stopping cleanly: a worker given SIGTERM finishes what it holds; ``sluice up`` given
SIGTERM still answers the request being computed and leaves no child behind (issue 4)."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import orjson
import pytest
from redis import Redis

from sluice.core.keys import Keys
from tests.faults.conftest import (
    MODEL,
    Report,
    exit_statuses,
    held_entries,
    request_ids,
    signal_a_busy_worker,
    taken_over_from,
)
from tests.support import procs
from tests.support.load import Answer, Load, check_response, slow_request
from tests.support.slow_model import write_slow
from tests.support.stack import Stack

REQUESTS = 2000
CLIENTS = 16


@pytest.mark.timeout(150)
def test_worker_sigterm_finishes_what_it_holds(
    two_workers: tuple[Stack, Redis], report: Report
) -> None:
    stack, redis = two_workers
    assert stack.process is not None

    load = Load(
        stack.url, MODEL, CLIENTS, REQUESTS, build=lambda i: slow_request(i, iters=20)
    ).start()
    time.sleep(1.0)
    victim, held = signal_a_busy_worker(redis, stack, signal.SIGTERM)
    signalled_at = time.monotonic()
    exited = procs.wait_until(lambda: not procs.alive(victim), 15)
    exit_s = time.monotonic() - signalled_at
    load.join(120)

    figures = load.figures()
    ok_ids = {f"req-{a.index}" for a in load.answers if a.correct}
    figures.update(
        held_at_sigterm=len(held),
        held_answered_ok=len(held & ok_ids),
        taken_over_from_stopped_worker=taken_over_from(stack, victim),
        worker_exit_after_s=round(exit_s, 2),
    )
    report(figures)

    assert exited, "the worker did not exit within 15 s of SIGTERM"
    assert procs.wait_until(lambda: bool(exit_statuses(stack)), 5)
    assert any("exited with status 0" in line for line in exit_statuses(stack)), exit_statuses(
        stack
    )
    assert figures["lost"] == 0
    assert figures["answered"] == figures["sent"] == REQUESTS
    assert figures["duplicated"] == 0
    assert figures["wrong_answers"] == 0
    assert figures["errors_by_status"] == {}, [a for a in load.answers if not a.correct][:5]
    assert held and held <= ok_ids
    # It answered what it held itself: nothing was left for another worker to take over.
    assert figures["taken_over_from_stopped_worker"] == 0


def _post(url: str, body: dict[str, object], index: int, out: list[Answer]) -> None:
    started = time.monotonic()
    with httpx.Client(base_url=url, timeout=60) as http:
        try:
            response = http.post(f"/v2/models/{MODEL}/infer", content=orjson.dumps(body))
        except httpx.HTTPError as exc:
            out.append(Answer(index, None, error=repr(exc), well_formed=False))
            return
        out.append(check_response(index, response, started))


def _calibrate(url: str, seconds: float) -> int:
    """ITERS that make one request compute for about ``seconds``."""
    iters = 50_000
    with httpx.Client(base_url=url, timeout=60) as http:
        started = time.monotonic()
        response = http.post(
            f"/v2/models/{MODEL}/infer", content=orjson.dumps(slow_request(0, iters))
        )
        assert response.status_code == 200, response.text
        elapsed = max(time.monotonic() - started, 0.01)
    return max(iters, int(iters * seconds / elapsed))


@pytest.mark.timeout(120)
def test_sluice_up_sigterm_answers_the_request_in_flight(
    tmp_path: Path,
    start_stack: Callable[..., Stack],
    redis_of: Callable[[Stack], Redis],
    report: Report,
) -> None:
    write_slow(tmp_path, MODEL, extra="dynamic_batching { max_queue_delay_microseconds: 1000 }")
    stack = start_stack(tmp_path)
    assert stack.process is not None
    redis = redis_of(stack)
    children = procs.children(stack.process.pid)
    gateways, workers = procs.gateway_pids(stack.process.pid), procs.worker_pids(stack.process.pid)
    assert gateways and len(workers) == 1, children  # the gateways and one worker
    assert set(children) == {*gateways, *workers}, children
    (worker,) = procs.worker_pids(stack.process.pid)
    # (Five seconds as calibrated: a machine that runs three times faster a moment later
    # still computes the slow request when the stop comes, a cheap request queued first.)
    iters = _calibrate(stack.url, 5.0)

    answers: list[Answer] = []
    slow = threading.Thread(
        target=_post, args=(stack.url, slow_request(1, iters), 1, answers), daemon=True
    )
    slow.start()
    # Wait until the worker holds the slow request: it is being computed.
    assert procs.wait_until(
        lambda: request_ids(redis, stack, held_entries(redis, stack, worker)) == {"req-1"}, 10
    )
    time.sleep(0.2)
    # A cheap request queued behind it, then the stop.
    queued = threading.Thread(
        target=_post, args=(stack.url, slow_request(2, 0), 2, answers), daemon=True
    )
    queued.start()
    # (Stopped before a gateway took it, it would be a connection reset by the closing port,
    # which is not what this is about: a busy machine may take a while to accept it.)
    stream = Keys(stack.namespace).request_streams(MODEL, 1, 0)[0]
    assert procs.wait_until(lambda: redis.xlen(stream) >= 2, 10), "req-2 never queued"
    computing_at_stop = "req-1" in request_ids(redis, stack, held_entries(redis, stack, worker))
    stopped_at = time.monotonic()
    stack.process.send_signal(signal.SIGTERM)
    status = stack.process.wait(60)
    stop_s = time.monotonic() - stopped_at
    slow.join(30)
    queued.join(30)
    gone = procs.wait_until(lambda: not any(procs.alive(pid) for pid in children), 10)

    by_index = {a.index: a for a in answers}
    report(
        {
            "iters": iters,
            "computing_at_stop": computing_at_stop,
            "exit_status": status,
            "stop_s": round(stop_s, 2),
            "in_flight_status": by_index[1].status if 1 in by_index else "none",
            "in_flight_latency_s": round(by_index[1].latency_s, 2) if 1 in by_index else None,
            "queued_status": by_index[2].status if 2 in by_index else "none",
            "children_left": sorted(pid for pid in children if procs.alive(pid)),
        }
    )
    assert computing_at_stop, "the slow request was no longer computing at SIGTERM (too fast?)"
    assert status == 0
    assert gone, "children of sluice up outlived it"
    assert len(answers) == 2, "a client thread got no answer at all"
    computing = by_index[1]
    assert computing.status == 200 and computing.correct, computing
    waiting = by_index[2]
    assert waiting.status is not None, f"the queued request's connection dropped: {waiting}"
    assert waiting.correct or (waiting.status >= 400 and waiting.well_formed), waiting
