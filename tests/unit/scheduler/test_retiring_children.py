"""Every retirement follows one rule: SIGTERM, then SIGKILL once the stop grace has passed
(no grace for a load abandoned at its deadline). The supervisor's retire, its stop and the
executor's scale-downs, with real processes that ignore SIGTERM and a real Redis."""

from __future__ import annotations

import signal
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from redis import Redis

from sluice.core.keys import Keys
from sluice.core.repository import RepositoryModel
from sluice.scheduler.executor.instances import Fleet, InstanceReconciler
from sluice.scheduler.executor.redis_server import RedisServer
from sluice.scheduler.executor.supervisor import (
    STOP_MARGIN_S,
    Child,
    ChildSpec,
    Supervisor,
    gateway_stop_s,
)
from tests.support import procs

STUBBORN = "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\ntime.sleep(120)\n"
GRACE_S = 0.5


def _worker_spec(version: int | None = 1) -> ChildSpec:
    return ChildSpec("worker m:1#0", [sys.executable, "-c", STUBBORN], {}, version=version)


@pytest.fixture
def supervisor() -> Iterator[Supervisor]:
    """A supervisor with a short stop grace; whatever it still runs is killed at the end."""
    supervisor = Supervisor([], stop_grace_s=GRACE_S)
    yield supervisor
    for child in supervisor.children:
        if child.process is not None and child.running:
            child.process.kill()
            child.process.wait(10)


def _ignoring_sigterm(supervisor: Supervisor, count: int = 1) -> list[Child]:
    """``count`` workers that have set SIGTERM aside (so that a SIGTERM finds them so)."""
    children = supervisor.add([_worker_spec() for _ in range(count)])
    for child in children:
        assert child.process is not None
        pid = child.process.pid
        assert procs.wait_until(lambda pid=pid: _ignores_sigterm(pid), 10), "never ready"
    return children


def _ignores_sigterm(pid: int) -> bool:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigIgn:"):
                return bool(int(line.split()[1], 16) & (1 << (signal.SIGTERM - 1)))
    except OSError:
        pass
    return False


def _gone(supervisor: Supervisor, children: list[Child], within_s: float) -> bool:
    """Tick ``supervisor`` (as ``sluice up``'s loop does) until ``children`` have exited."""

    def exited() -> bool:
        supervisor.tick()
        return not any(c.running for c in children)

    return bool(procs.wait_until(exited, within_s, 0.02))


def test_a_retired_worker_that_ignores_sigterm_is_killed_after_the_grace(
    supervisor: Supervisor,
) -> None:
    [child] = _ignoring_sigterm(supervisor)
    asked = time.monotonic()
    supervisor.retire([child])
    assert supervisor.busy  # (the loop ticks often until it is gone)
    time.sleep(GRACE_S / 2)
    supervisor.tick()
    assert child.running  # within its grace: left alone
    assert _gone(supervisor, [child], 10), "still running"
    assert time.monotonic() - asked >= GRACE_S
    assert child.process is not None and child.process.poll() == -signal.SIGKILL
    supervisor.tick()
    assert child not in supervisor.children and not supervisor.busy


def test_a_retirement_without_grace_kills_at_once(supervisor: Supervisor) -> None:
    """A load abandoned at its deadline: its workers hold no request, and one stuck in its
    model's loading does not end on SIGTERM."""
    [child] = _ignoring_sigterm(supervisor)
    supervisor.retire([child], grace_s=0.0)
    assert child.process is not None and child.process.wait(5) == -signal.SIGKILL


def test_the_stop_kills_a_worker_that_ignores_sigterm_after_the_grace(
    supervisor: Supervisor,
) -> None:
    """Not after the 15 s the other children (a gateway finishing its requests) get."""
    [child] = _ignoring_sigterm(supervisor)
    started = time.monotonic()
    supervisor.stop()
    took_s = time.monotonic() - started
    assert child.process is not None and child.process.poll() == -signal.SIGKILL
    assert GRACE_S <= took_s < 5, took_s


def test_the_stop_gives_other_children_their_own_time(supervisor: Supervisor) -> None:
    """A gateway may take its shutdown timeout to answer what it holds: a short worker
    grace does not cut it short."""
    script = "import signal, sys, time\nsignal.signal(signal.SIGTERM, lambda *_: sys.exit(0))\n"
    script += "time.sleep(120)\n"
    spec = ChildSpec("gateway", [sys.executable, "-c", script], {})
    [child] = supervisor.add([spec])
    time.sleep(0.5)  # (its handler set)
    supervisor.stop(timeout_s=3)
    assert child.process is not None and child.process.poll() == 0


@pytest.fixture
def client(redis_server: RedisServer) -> Iterator[Redis]:
    client = Redis.from_url(redis_server.url)
    yield client
    client.close()


def test_a_scale_down_kills_a_worker_that_ignores_sigterm_after_the_grace(
    supervisor: Supervisor, client: Redis
) -> None:
    keys = Keys(f"t{uuid.uuid4().hex[:8]}")
    model = RepositoryModel("m", Path("m"), None, (1,))
    children = _ignoring_sigterm(supervisor, 2)
    fleet: Fleet = {"m": (model, list(children))}
    reconciler = InstanceReconciler(
        client, keys, supervisor, fleet, lambda model, version, threads: _worker_spec()
    )
    client.hset(keys.desired_instances, "m:1", 1)
    reconciler.tick()
    [kept] = fleet["m"][1]
    [leaving] = [c for c in children if c is not kept]
    assert leaving.retiring
    assert _gone(supervisor, [leaving], 10), "the worker scaled away still runs"
    assert leaving.process is not None and leaving.process.poll() == -signal.SIGKILL
    assert kept.running


@pytest.mark.slow
def test_the_stop_gives_a_gateway_its_drain_and_a_margin_then_kills_it() -> None:
    """``SLUICE_SHUTDOWN_TIMEOUT_S`` (Triton's ``--exit-timeout-secs``) and 5 s: not a fixed
    15 s, which cut a longer drain short."""
    assert gateway_stop_s(60) == 60 + STOP_MARGIN_S
    supervisor = Supervisor([], stop_grace_s=GRACE_S, others_stop_s=1.0)
    [child] = supervisor.add([_worker_spec(version=None)])  # (a gateway that never exits)
    assert child.process is not None
    pid = child.process.pid
    assert procs.wait_until(lambda: _ignores_sigterm(pid), 10), "never ready"
    started = time.monotonic()
    supervisor.stop()
    took_s = time.monotonic() - started
    assert child.process.poll() == -signal.SIGKILL
    assert 1.0 <= took_s < 5, took_s
