"""Workers asked to stop are followed until they are gone: one that ignores SIGTERM is
killed once its grace has passed, and what it holds counts until then (real processes).
The supervisor follows every child it retires so (``test_retiring_children.py``)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from sluice.core.memory_budget import HOST
from sluice.scheduler.executor.leaving import LeavingWorkers, footprint
from sluice.scheduler.executor.supervisor import Child, ChildSpec

MIB = 1 << 20
STUBBORN = (
    "import signal, time\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "ballast = b'x' * (8 << 20)\n"
    "print('ready', flush=True)\n"
    "time.sleep(60)\n"
)
OBEDIENT = "import time\nprint('ready', flush=True)\ntime.sleep(60)\n"


def _worker(code: str) -> Child:
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert process.stdout is not None and process.stdout.readline() == b"ready\n"
    return Child(ChildSpec("worker m:1#0", [], {}, version=1), process)


@pytest.fixture
def started() -> Iterator[list[Child]]:
    """The workers a test starts, killed at its end whatever happened."""
    children: list[Child] = []
    yield children
    for child in children:
        if child.process is not None and child.running:
            child.process.kill()
        if isinstance(child.process, subprocess.Popen):
            child.process.wait(10)
            if child.process.stdout is not None:
                child.process.stdout.close()


def _stop(leaving: LeavingWorkers, child: Child, grace_s: float | None = None) -> None:
    assert child.process is not None
    child.process.terminate()  # (as Supervisor.retire asks)
    leaving.add([child], grace_s)


def _gone(leaving: LeavingWorkers, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        leaving.sweep()
        if not leaving:
            return True
        time.sleep(0.02)
    return False


def test_a_worker_that_ignores_sigterm_is_killed_after_its_grace(started: list[Child]) -> None:
    child = _worker(STUBBORN)
    started.append(child)
    assert child.process is not None
    pid = child.process.pid
    leaving = LeavingWorkers(grace_s=0.6)
    _stop(leaving, child)
    time.sleep(0.3)
    leaving.sweep()
    assert child.running and len(leaving) == 1  # within its grace: left alone
    # Until it is gone, what it holds counts: its own memory, and its GPU memory.
    held = footprint([child], {pid: {"gpu0": 5 * MIB}})
    assert held[HOST] > 8 * MIB and held["gpu0"] == 5 * MIB
    assert _gone(leaving, within_s=5.0)
    assert child.process.poll() == -signal.SIGKILL
    assert footprint([child], {pid: {"gpu0": 5 * MIB}}) == {}


def test_a_worker_that_exits_on_sigterm_is_not_killed(started: list[Child]) -> None:
    child = _worker(OBEDIENT)
    started.append(child)
    assert child.process is not None
    leaving = LeavingWorkers(grace_s=30.0)
    _stop(leaving, child)
    assert _gone(leaving, within_s=5.0)
    assert child.process.poll() == -signal.SIGTERM


def test_no_grace_kills_at_once(started: list[Child]) -> None:
    """A load abandoned at its deadline: its workers are killed as they are let go."""
    child = _worker(STUBBORN)
    started.append(child)
    assert child.process is not None
    leaving = LeavingWorkers(grace_s=30.0)
    _stop(leaving, child, grace_s=0.0)
    assert child.process.wait(5) == -signal.SIGKILL
    leaving.sweep()
    assert not leaving


def test_a_worker_followed_twice_keeps_the_earlier_deadline(started: list[Child]) -> None:
    """Retired with the stop grace, then given none (everything stops, or its load is
    abandoned): it is killed at once, and followed once."""
    child = _worker(STUBBORN)
    started.append(child)
    assert child.process is not None
    leaving = LeavingWorkers(grace_s=30.0)
    _stop(leaving, child)
    _stop(leaving, child, grace_s=0.0)
    assert child.process.wait(5) == -signal.SIGKILL
    leaving.add([child], grace_s=60.0)  # (gone: not followed again)
    leaving.sweep()
    assert not leaving
