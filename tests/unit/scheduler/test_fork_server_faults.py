"""A fork server that cannot fork one worker, or stalls: that worker is started the ordinary
way, the workers it forked before go on, and the executor waits at most
:data:`ANSWER_WITHIN_S` for it. Real fork servers (one whose ``fork`` fails while a file
exists, as when the process table is full), real forked workers loading a real model."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sluice.core.runtime import pid_alive
from sluice.scheduler.executor.fork_server import ANSWER_WITHIN_S, ForkServer
from sluice.scheduler.executor.redis_server import RedisServer
from sluice.scheduler.executor.supervisor import ChildSpec
from tests.support import procs
from tests.support.model_files import write_model
from tests.support.stubborn_models import CONFIG, model_source, pid_in

_FORK_FAILS_WHILE = """
import errno, os, sys
real_fork = os.fork
def fork():
    if os.path.exists({flag!r}):
        raise OSError(errno.EAGAIN, "Resource temporarily unavailable")
    return real_fork()
os.fork = fork
from sluice.workers.__main__ import fork_server
sys.exit(fork_server())
"""


@pytest.fixture
def repository(tmp_path: Path) -> Path:
    """Models whose load never ends (each writes its worker's pid first): a worker that
    stays up without a request."""
    for name in ("first", "second", "third"):
        source = model_source(tmp_path / f"{name}.pid", hangs=True)
        write_model(tmp_path / "models", name, CONFIG, {"1/model.py": source})
    return tmp_path


@pytest.fixture
def servers() -> Iterator[list[ForkServer]]:
    """The servers a test starts; each stopped at the end, its workers killed."""
    started: list[ForkServer] = []
    yield started
    for server in started:
        if server.process is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(server.process.pid, signal.SIGCONT)
            for pid in procs.children(server.process.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        server.stop()


def _server(
    servers: list[ForkServer], redis_server: RedisServer, argv: tuple[str, ...] | None = None
) -> ForkServer:
    env = dict(os.environ, SLUICE_REDIS_URL=redis_server.url, SLUICE_NAMESPACE="forkfaults")
    server = ForkServer(env) if argv is None else ForkServer(env, argv=argv)
    servers.append(server)
    server.ensure()
    assert procs.wait_until(lambda: server.ready, 60), "the fork server never said ready"
    return server


def _spec(repository: Path, name: str) -> ChildSpec:
    argv = [sys.executable, "-m", "sluice.workers"]
    argv += ["--model-repository", str(repository / "models"), "--model", name, "--version", "1"]
    return ChildSpec(f"worker {name}:1#0", argv, {**os.environ}, version=1)


def _loading(repository: Path, name: str) -> int:
    """The pid of the worker of ``name`` once it loads its model."""
    assert procs.wait_until(lambda: pid_in(repository / f"{name}.pid") is not None, 60)
    pid = pid_in(repository / f"{name}.pid")
    assert pid is not None
    return pid


@pytest.mark.timeout(120)
def test_a_fork_that_fails_fails_that_worker_only(
    repository: Path, servers: list[ForkServer], redis_server: RedisServer
) -> None:
    flag = repository / "process-table-full"
    script = _FORK_FAILS_WHILE.format(flag=str(flag))
    server = _server(servers, redis_server, (sys.executable, "-c", script))
    first = server.spawn(_spec(repository, "first"))
    assert first is not None and _loading(repository, "first") == first.pid

    flag.touch()
    asked = time.monotonic()
    assert server.spawn(_spec(repository, "second")) is None  # (started the ordinary way)
    assert time.monotonic() - asked < ANSWER_WITHIN_S
    assert server.ready, "the fork server did not go on after a fork failed"
    assert pid_alive(first.pid) and first.poll() is None

    flag.unlink()
    third = server.spawn(_spec(repository, "third"))
    assert third is not None and _loading(repository, "third") == third.pid
    assert pid_alive(first.pid)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_stalled_fork_server_is_waited_for_once_and_its_late_fork_killed(
    repository: Path, servers: list[ForkServer], redis_server: RedisServer
) -> None:
    server = _server(servers, redis_server)
    assert server.process is not None
    server_pid = server.process.pid
    first = server.spawn(_spec(repository, "first"))
    assert first is not None and _loading(repository, "first") == first.pid

    os.kill(server_pid, signal.SIGSTOP)
    asked = time.monotonic()
    assert server.spawn(_spec(repository, "second")) is None
    waited_s = time.monotonic() - asked
    assert ANSWER_WITHIN_S <= waited_s < 10 * ANSWER_WITHIN_S, waited_s
    asked = time.monotonic()
    assert server.spawn(_spec(repository, "third")) is None  # not asked while it stalls
    assert time.monotonic() - asked < ANSWER_WITHIN_S / 10
    assert pid_alive(first.pid) and first.poll() is None

    os.kill(server_pid, signal.SIGCONT)
    assert procs.wait_until(lambda: server.ready, 30), "not asked again once it answered"
    # The worker it forked for the order given up on is killed, not left unsupervised.
    assert procs.wait_until(lambda: procs.children(server_pid) == {first.pid}, 30)
    late = pid_in(repository / "second.pid")
    assert late is None or not pid_alive(late)
    third = server.spawn(_spec(repository, "third"))
    assert third is not None and _loading(repository, "third") == third.pid
    assert pid_alive(first.pid)
