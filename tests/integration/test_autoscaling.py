"""Autoscaling on one machine: a burst adds workers, they go again after a quiet window (down
to zero), no request is lost on the way, and the first request to a model with no worker
starts one.

The burst's requests are held by a gate model (tests/support/gate_model.py) until the test
has seen the workers it waits for: a burst that computed for a guessed time could end, on a
busy machine, before the controller had looked at it."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from sluice.core.keys import Keys
from sluice.core.redis_client.connect import connect
from sluice.scheduler.executor.redis_server import RedisServer
from tests.support.gate_model import BLOCKER_ITERS, open_gate, write_gate
from tests.support.load import slow_request
from tests.support.procs import wait_until, worker_pids
from tests.support.stack import Stack

POLICY = """
parameters { key: "sluice.min_instances" value { string_value: "0" } }
parameters { key: "sluice.max_instances" value { string_value: "3" } }
parameters { key: "sluice.latency_objective_ms" value { string_value: "400" } }
parameters { key: "sluice.scale_down_window_s" value { string_value: "2" } }
"""


def write_held(repository: Path, extra: str) -> Path:
    """The gate model ``slow`` (one instance, batches of one) with ``extra`` parameters in
    ``repository``, and its gate folder (closed)."""
    config = write_gate(repository, "slow") / "config.pbtxt"
    config.write_text(config.read_text() + extra)
    gate = repository.parent / "gate"
    gate.mkdir()
    return gate


class Burst:
    """``count`` requests to the ``slow`` gate model sent at once, one thread each, each held
    by the worker that takes it until the gate opens."""

    def __init__(self, stack: Stack, count: int) -> None:
        self._codes: list[int] = []
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._send, args=(stack.url, index)) for index in range(count)
        ]
        for thread in self._threads:
            thread.start()

    def _send(self, url: str, index: int) -> None:
        with httpx.Client(base_url=url, timeout=120) as http:
            request = slow_request(index, BLOCKER_ITERS)
            code = http.post("/v2/models/slow/infer", json=request).status_code
        with self._lock:
            self._codes.append(code)

    def codes(self) -> list[int]:
        """Every request's status code, once all are answered."""
        for thread in self._threads:
            thread.join(120)
        return sorted(self._codes)


@pytest.fixture
def scaling(tmp_path: Path, redis_server: RedisServer) -> Iterator[Stack]:
    gate = write_held(tmp_path / "models", POLICY)
    stack = Stack(tmp_path / "models", redis_server.url, env={"SLUICE_TEST_GATE": str(gate)})
    stack.start()
    yield stack
    open_gate(gate, "slow")
    stack.stop()


@pytest.mark.timeout(180)
def test_burst_scales_up_then_down_to_zero_and_back_without_losing_requests(
    scaling: Stack,
) -> None:
    assert scaling.process is not None
    root = scaling.process.pid
    assert len(worker_pids(root, "slow")) == 1
    started = time.monotonic()
    burst = Burst(scaling, 40)
    assert wait_until(lambda: len(worker_pids(root, "slow")) >= 2, 60), "no scale-up"
    scaled_up_s = time.monotonic() - started
    open_gate(Path(scaling.env["SLUICE_TEST_GATE"]), "slow")
    assert burst.codes() == [200] * 40
    # Quiet now: after windows of 2 s, halving each time, down to zero (the minimum).
    assert wait_until(lambda: not worker_pids(root, "slow"), 60), _why_not_down(scaling)
    cold = time.monotonic()
    with httpx.Client(base_url=scaling.url, timeout=60) as http:
        answer = http.post("/v2/models/slow/infer", json=slow_request(99, 10))
    assert answer.status_code == 200, answer.text
    cold_start_s = time.monotonic() - cold
    print(
        f"scaled up {scaled_up_s:.1f} s into the burst; cold start answered in {cold_start_s:.1f} s"
    )
    assert any("scaling 'slow' version 1 up" in line for line in scaling.stderr_lines)


@pytest.mark.timeout(180)
def test_controllers_of_their_own_scale_the_workers_and_a_standby_takes_over(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """``sluice up --no-controller`` only carries out; two ``sluice controller`` processes
    decide. The leader is killed in the middle of a burst: the standby goes on scaling,
    and every request is answered."""
    gate = write_held(tmp_path / "models", POLICY)
    stack = Stack(
        tmp_path / "models",
        redis_server.url,
        env={"SLUICE_TEST_GATE": str(gate)},
        args=["--no-controller"],
    )
    controllers: list[subprocess.Popen[str]] = []
    env = dict(os.environ, SLUICE_REDIS_URL=redis_server.url, SLUICE_NAMESPACE=stack.namespace)
    stack.start()
    try:
        assert stack.process is not None
        root = stack.process.pid
        time.sleep(3)  # no controller yet: nothing is decided, the configured instance serves
        assert len(worker_pids(root, "slow")) == 1
        command = [sys.executable, "-m", "sluice.cli", "controller"]
        command += ["--model-repository", str(tmp_path / "models")]

        def start_controller() -> tuple[subprocess.Popen[str], list[str]]:
            process = subprocess.Popen(
                command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env
            )
            controllers.append(process)
            lines: list[str] = []
            assert process.stdout is not None
            threading.Thread(target=lambda: lines.extend(process.stdout), daemon=True).start()
            return process, lines

        def leads(lines: list[str]) -> bool:
            return any(" leads " in line for line in lines)

        # The leader first, then the standby: which one leads is then certain.
        leader, leader_lines = start_controller()
        assert wait_until(lambda: leads(leader_lines), 15), leader_lines
        _standby, standby_lines = start_controller()
        assert wait_until(lambda: any(" started" in line for line in standby_lines), 15)
        burst = Burst(stack, 60)
        assert wait_until(lambda: len(worker_pids(root, "slow")) >= 2, 60), "no scale-up"
        leader.kill()
        killed = time.monotonic()
        # (Its lease lasts 3 s; then the standby takes it at its next attempt.)
        assert wait_until(lambda: leads(standby_lines), 30), standby_lines
        print(f"the standby leads {time.monotonic() - killed:.1f} s after the leader's death")
        open_gate(gate, "slow")
        assert burst.codes() == [200] * 60
        # The standby's decisions: down to zero once quiet.
        assert wait_until(lambda: not worker_pids(root, "slow"), 60), "did not scale down"
    finally:
        open_gate(gate, "slow")
        for process in controllers:
            process.kill()
            process.wait(10)
            if process.stdout is not None:
                process.stdout.close()
        stack.stop()


def _why_not_down(stack: Stack) -> str:
    """What the controller saw: the lengths of the model's streams, and the last lines the
    stack logged (a worker asked to stop logs nothing more)."""
    assert stack.redis_url is not None
    client = connect(stack.redis_url)
    try:
        keys = Keys(stack.namespace)
        tenants = sorted(str(s) for s in client.smembers(keys.tenant_streams("slow", 1)))
        lengths = {s: client.xlen(s) for s in [keys.request_stream("slow", 1), *tenants]}
    finally:
        client.close()
    return f"did not scale down to zero; streams {lengths}\n" + "".join(stack.stderr_lines[-30:])


ON_DEMAND = (
    POLICY.replace('string_value: "0"', 'string_value: "1"', 1)
    + 'parameters { key: "sluice.load" value { string_value: "on_demand" } }\n'
)


@pytest.mark.timeout(180)
def test_an_on_demand_model_is_loaded_then_scaled_up_and_down_by_its_queue(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """A model loaded on demand that has an autoscaling policy: the first requests load it,
    the burst gives it more workers within the memory budget, and it goes back to one
    (not to none: unloading it is the budget's business) once quiet."""
    gate = write_held(tmp_path / "models", ON_DEMAND)
    # Workers started as processes of their own, not forked: each is a child of
    # ``sluice up`` that names its model, so that they can be counted here.
    stack = Stack(
        tmp_path / "models",
        redis_server.url,
        env={"SLUICE_FORK_SERVER": "false", "SLUICE_TEST_GATE": str(gate)},
    )
    stack.start()
    try:
        assert stack.process is not None
        root = stack.process.pid
        assert worker_pids(root, "slow") == set()  # not loaded until asked for
        burst = Burst(stack, 40)
        assert wait_until(lambda: len(worker_pids(root, "slow")) >= 2, 60), (
            "no scale-up within 60 s:\n" + "".join(stack.stderr_lines[-20:])
        )
        open_gate(gate, "slow")
        assert burst.codes() == [200] * 40
        assert wait_until(lambda: len(worker_pids(root, "slow")) == 1, 60), _why_not_down(stack)
        time.sleep(3)  # two more windows: it stays at one
        assert len(worker_pids(root, "slow")) == 1
        assert any("instances (autoscaling)" in line for line in stack.stderr_lines)
    finally:
        open_gate(gate, "slow")
        stack.stop()
