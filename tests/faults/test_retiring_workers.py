"""Workers asked to stop that never do, outside on-demand loading: an unload whose worker
ignores SIGTERM, a load abandoned at ``SLUICE_MODEL_CONTROL_TIMEOUT_S`` whose worker hangs
in its model's loading, and the stop of ``sluice up`` with a worker the fork server forked
that ignores SIGTERM. Each worker is killed (after ``SLUICE_WORKER_STOP_GRACE_S``, or at
once for the abandoned load). Real workers, real Redis, small timeouts."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from sluice.scheduler.executor.redis_server import RedisServer
from tests.support import procs
from tests.support.model_files import write_model
from tests.support.stack import Stack
from tests.support.stubborn_models import CONFIG, REQUEST, model_source, pid_in

STOP_GRACE_S = 1
CONTROL_TIMEOUT_S = 8


def _fork_server_ready(stack: Stack) -> bool:
    """(It starts with the executor's first tick, after the stack is ready, and forks once
    it has done its imports: a load before starts its worker as a process of its own.)"""
    return "the fork server has done its imports" in _log(stack)


def _log(stack: Stack) -> str:
    return "".join(stack.stderr_lines)


@pytest.fixture(scope="module")
def explicit(
    tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer
) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("retiring")
    repository = root / "models"
    for name, options in (("stubborn", {"ignores_sigterm": True}), ("hangs", {"hangs": True})):
        pid_file = root / f"{name}.pid"
        source = model_source(pid_file, **options)
        write_model(repository, name, CONFIG, {"1/model.py": source})
    stack = Stack(
        repository,
        redis_server.url,
        env={
            "SLUICE_MODEL_CONTROL_MODE": "explicit",
            "SLUICE_MODEL_CONTROL_TIMEOUT_S": str(CONTROL_TIMEOUT_S),
            "SLUICE_WORKER_STOP_GRACE_S": str(STOP_GRACE_S),
        },
    )
    stack.start()
    yield stack
    stack.stop()


@pytest.mark.timeout(120)
def test_an_unload_kills_a_worker_that_ignores_sigterm_after_the_grace(explicit: Stack) -> None:
    """The unload answers once the worker is gone: without the kill it never would, and
    model control would carry out no other command."""
    pid_file = Path(str(explicit.repository)).parent / "stubborn.pid"
    with httpx.Client(base_url=explicit.url, timeout=60) as http:
        answer = http.post("/v2/repository/models/stubborn/load")
        assert answer.status_code == 200, answer.text
        assert http.post("/v2/models/stubborn/infer", json=REQUEST).status_code == 200
        worker = pid_in(pid_file)
        assert worker is not None and procs.alive(worker)

        asked = time.monotonic()
        answer = http.post("/v2/repository/models/stubborn/unload")
        took_s = time.monotonic() - asked
        assert answer.status_code == 200, answer.text
        assert STOP_GRACE_S <= took_s < CONTROL_TIMEOUT_S, took_s
        assert not procs.alive(worker), "the worker that ignored SIGTERM still runs"
    killed = f"did not exit within {STOP_GRACE_S} s of SIGTERM; killing it (SIGKILL)"
    assert killed in _log(explicit)


@pytest.mark.timeout(120)
def test_a_load_abandoned_at_its_deadline_kills_its_worker(explicit: Stack) -> None:
    """A Python model whose loading never ends: a worker stuck there does not end on
    SIGTERM, so at ``SLUICE_MODEL_CONTROL_TIMEOUT_S`` it is killed at once."""
    pid_file = Path(str(explicit.repository)).parent / "hangs.pid"
    with httpx.Client(base_url=explicit.url, timeout=60) as http:
        answer = http.post("/v2/repository/models/hangs/load")
        # (The gateway waits as long as the executor does: either may tell first.)
        assert answer.status_code in (400, 503), answer.text
        worker = pid_in(pid_file)
        assert worker is not None
        assert procs.wait_until(lambda: not procs.alive(worker), 5), "its worker still runs"
    failed = (
        f"load of 'hangs' failed: failed to load 'hangs', not ready within {CONTROL_TIMEOUT_S} s"
    )
    assert failed in _log(explicit)


@pytest.mark.timeout(120)
def test_the_stop_kills_a_forked_worker_that_ignores_sigterm_after_the_grace(
    tmp_path: Path, start_stack: Callable[..., Stack]
) -> None:
    """A worker the fork server forked is stopped with every other child, while the fork
    server still reaps it: the stop takes the grace, not the fork server's own wait (10 s)
    and then the supervisor's."""
    repository = tmp_path / "models"
    pid_file = tmp_path / "stubborn.pid"
    source = model_source(pid_file, ignores_sigterm=True)
    write_model(repository, "stubborn", CONFIG, {"1/model.py": source})
    stack = start_stack(
        repository,
        env={
            "SLUICE_MODEL_CONTROL_MODE": "demand",
            "SLUICE_WORKER_STOP_GRACE_S": str(STOP_GRACE_S),
        },
    )
    assert stack.process is not None
    assert procs.wait_until(lambda: _fork_server_ready(stack), 60), "no fork server"
    with httpx.Client(base_url=stack.url, timeout=60) as http:
        answer = http.post("/v2/models/stubborn/infer", json=REQUEST)
        assert answer.status_code == 200, answer.text
    worker = pid_in(pid_file)
    assert worker is not None and procs.alive(worker)
    assert f"(pid {worker}, forked)" in _log(stack)

    asked = time.monotonic()
    assert stack.stop() == 0
    took_s = time.monotonic() - asked
    assert not procs.alive(worker), "the worker that ignored SIGTERM still runs"
    assert took_s < 15, took_s  # (it took the fork server's 10 s, then the supervisor's 15)
    killed = f"did not exit within {STOP_GRACE_S} s of SIGTERM; killing it (SIGKILL)"
    assert killed in _log(stack)
