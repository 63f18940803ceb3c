"""How long ``sluice up``'s children have when it stops or dies: a gateway drains for the
whole ``--exit-timeout-secs`` (not a fixed 15 s), gRPC at the same time as HTTP, and a
worker that ignores SIGTERM does not outlive a ``sluice up`` killed with SIGKILL by more
than ``SLUICE_WORKER_STOP_GRACE_S``.
Real stacks, a real held request, a real stubborn worker."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from redis import Redis

from sluice.scheduler.executor.redis_server import RedisServer
from tests.faults.conftest import held_entries
from tests.support import procs
from tests.support.gate_model import BLOCKER_ITERS, open_gate, write_gate
from tests.support.load import slow_request
from tests.support.model_files import write_model
from tests.support.stack import Stack
from tests.support.stubborn_models import CONFIG, model_source, pid_in

EXIT_TIMEOUT_S = 160
"""Ten times the drain the request below needs."""
HELD_FOR_S = 16.0
"""How long after the stop the held request is answered: past the fixed 15 s a gateway
had before it was killed."""


def _grpc_refuses_new_calls(address: str) -> bool:
    """Whether the gateway's gRPC server is draining: its health check answers NOT_SERVING
    or the call is refused (a draining grpc server refuses new calls)."""
    with grpc.insecure_channel(address) as channel:
        try:
            answer = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=5
            )
        except grpc.RpcError:
            return True
    return bool(answer.status == health_pb2.HealthCheckResponse.NOT_SERVING)


def _held_by_a_worker(redis: Redis, stack: Stack) -> bool:
    assert stack.process is not None
    pids = procs.worker_pids(stack.process.pid, "slow")
    return any(held_entries(redis, stack, pid, "slow") for pid in pids)


@pytest.mark.timeout(EXIT_TIMEOUT_S + 120)
def test_a_gateway_drains_for_the_whole_exit_timeout(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    repository, gate = tmp_path / "models", tmp_path / "gate"
    gate.mkdir()
    write_gate(repository, "slow")
    stack = Stack(
        repository,
        redis_server.url,
        env={"SLUICE_TEST_GATE": str(gate)},
        args=[f"--exit-timeout-secs={EXIT_TIMEOUT_S}"],
    )
    stack.start()
    redis = Redis.from_url(redis_server.url)
    answers: list[httpx.Response | Exception] = []

    def ask() -> None:
        with httpx.Client(base_url=stack.url, timeout=EXIT_TIMEOUT_S) as http:
            try:
                answers.append(
                    http.post("/v2/models/slow/infer", json=slow_request(1, BLOCKER_ITERS))
                )
            except httpx.HTTPError as exc:
                answers.append(exc)

    caller = threading.Thread(target=ask, daemon=True)
    try:
        assert stack.process is not None
        caller.start()
        assert procs.wait_until(lambda: _held_by_a_worker(redis, stack), 30), "never held"
        assert not _grpc_refuses_new_calls(stack.grpc_address)
        stack.process.send_signal(signal.SIGTERM)
        stopped = time.monotonic()
        # gRPC drains while HTTP does, not after it: new calls are refused during the hold.
        assert procs.wait_until(lambda: _grpc_refuses_new_calls(stack.grpc_address), 10)
        time.sleep(max(0.0, HELD_FOR_S - (time.monotonic() - stopped)))
        assert stack.process.poll() is None, "sluice up ended before the request did"
        open_gate(gate, "slow")
        caller.join(60)
        assert answers and isinstance(answers[0], httpx.Response), answers
        assert answers[0].status_code == 200, answers[0].text
        assert stack.process.wait(60) == 0
        took_s = time.monotonic() - stopped
        assert took_s < EXIT_TIMEOUT_S, took_s  # (it ended once drained, not when killed)
        log = "".join(stack.stderr_lines)
        assert "killing it (SIGKILL)" not in log
    finally:
        open_gate(gate, "slow")
        stack.stop()
        redis.close()


@pytest.mark.timeout(120)
def test_a_worker_does_not_outlive_a_killed_sluice_up_by_more_than_the_grace(
    tmp_path: Path, start_stack: Callable[..., Stack]
) -> None:
    """Its parent's death sends it SIGTERM, which it ignores: it kills itself once the
    grace has passed."""
    grace_s = 1
    pid_file = tmp_path / "stubborn.pid"
    source = model_source(pid_file, ignores_sigterm=True)
    write_model(tmp_path / "models", "stubborn", CONFIG, {"1/model.py": source})
    stack = start_stack(tmp_path / "models", env={"SLUICE_WORKER_STOP_GRACE_S": str(grace_s)})
    assert stack.process is not None
    worker = pid_in(pid_file)
    assert worker is not None and procs.alive(worker)
    try:
        stack.process.kill()
        stack.process.wait(30)
        assert procs.alive(worker) or True  # (SIGTERM came: it ignores it)
        assert procs.wait_until(lambda: not procs.alive(worker), 10 * (grace_s + 1)), (
            "the worker that ignores SIGTERM outlived sluice up"
        )
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(worker, signal.SIGKILL)
