"""Workers forked from one process that has done their imports, for on-demand loads.

Starting a worker costs about a second of CPU here before it reads its model, nearly all of
it Python importing numpy, onnxruntime and Sluice's worker. The fork server
(``python -m sluice.workers --fork-server``) does that once and forks a worker for each load:
the worker starts in milliseconds, with only its model left to read, and the imported
pages stay shared between the workers until one writes to them. A load then costs tens of
milliseconds of CPU instead of a second, so a host can load several models a second.

The executor orders a worker with one JSON line on the server's stdin and reads the answer,
``started <pid>`` or ``failed <why>``; the server, the only one that can wait for its
children, reports ``exited <pid> <status>``. :class:`ForkedProcess` gives the supervisor
what it needs of a ``Popen`` (poll, terminate, kill, wait). If such a worker dies, the
supervisor starts it again the ordinary way, from its arguments. If the server dies, its
workers get SIGTERM (they die with their parent) and the next load starts a new server.

A fork that fails concerns that worker only: the server answers ``failed`` (out of
processes or memory) and goes on, or it does not answer within :data:`ANSWER_WITHIN_S`
(stalled: stopped, swapping), and the worker is started the ordinary way instead (a start
that fails too is retried, and the load refused, as any other: :mod:`.supervisor`). The
server is left
running, since the workers it forked are its children: it is not asked again until it
answers, and a worker it forks for an order given up on is killed at once. The tick loop
waits for a server neither while it does its imports (it says ``ready``) nor longer than
:data:`ANSWER_WITHIN_S`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO

from sluice.core.runtime import die_with_parent, pid_alive
from sluice.scheduler.executor.supervisor import ChildSpec

log = logging.getLogger("sluice.up")

FORK_SERVER_ARGV = (sys.executable, "-m", "sluice.workers", "--fork-server")
_WORKER_ARGS_FROM = 3
"""A worker spec's argv is ``python -m sluice.workers <arguments>``."""
ANSWER_WITHIN_S = 1.0
"""How long the tick loop waits for the server's answer to an order (a fork takes
milliseconds): a tick while nothing else is in progress."""


@dataclass
class _Order:
    """One order sent, until the server answers it."""

    name: str
    answered: threading.Event = field(default_factory=threading.Event)
    pid: int | None = None
    failure: str = "the fork server exited"
    given_up: bool = False
    """The executor stopped waiting (the worker was started the ordinary way)."""


@dataclass
class ForkServer:
    env: dict[str, str]
    on_exit: Callable[[], None] = lambda: None
    """Called when a forked worker exits (wakes the executor's tick loop)."""
    argv: tuple[str, ...] = FORK_SERVER_ARGV
    process: subprocess.Popen[bytes] | None = None
    exit_codes: dict[int, int] = field(default_factory=dict)
    _orders: deque[_Order] = field(default_factory=deque)
    """The orders sent and not answered yet, oldest first (the server answers in order)."""
    _ready: threading.Event = field(default_factory=threading.Event)
    _stalled: bool = False
    """An order went unanswered: no more until the server answers it."""
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _reader: threading.Thread | None = None

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    @property
    def ready(self) -> bool:
        """It runs, has done its imports and answers its orders."""
        return self.alive and self._ready.is_set() and not self._stalled

    def ensure(self) -> None:
        """Start the server unless it runs (it does its imports meanwhile)."""
        if self.alive:
            return
        self.process = subprocess.Popen(
            list(self.argv),
            env=self.env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
        with self._lock:
            self._orders, self._ready, self._stalled = deque(), threading.Event(), False
        assert self.process.stdout is not None
        self._reader = threading.Thread(
            target=self._read,
            args=(self.process.stdout, self._orders, self._ready),
            name="fork-server",
            daemon=True,
        )
        self._reader.start()

    def spawn(self, spec: ChildSpec) -> ForkedProcess | None:
        """The worker of ``spec``, forked; None where the server cannot (start it the
        ordinary way then): not ready, or the fork failed or was not answered in time."""
        is_worker = list(spec.argv[1:_WORKER_ARGS_FROM]) == ["-m", "sluice.workers"]
        if not self.ready or not is_worker or spec.pass_fds:
            return None
        assert self.process is not None and self.process.stdin is not None
        order = _Order(spec.name)
        line = json.dumps({"argv": list(spec.argv[_WORKER_ARGS_FROM:]), "env": spec.env})
        try:
            with self._lock:
                self._orders.append(order)
            # (Every earlier order was answered, so the pipe is empty: this does not block.)
            self.process.stdin.write(line.encode() + b"\n")
            self.process.stdin.flush()
        except OSError as exc:
            order.failure = str(exc)
            order.answered.set()
        if not order.answered.wait(ANSWER_WITHIN_S):
            with self._lock:
                if not order.answered.is_set():
                    order.given_up, self._stalled = True, True
            if order.given_up:
                log.warning(
                    "the fork server did not answer within %g s; starting %s as a process "
                    "of its own (and the next workers, until the server answers again)",
                    ANSWER_WITHIN_S,
                    spec.name,
                )
                return None
        if order.pid is None:
            log.warning(
                "the fork server could not start %s (%s); starting it as a process of its own",
                spec.name,
                order.failure,
            )
            return None
        return ForkedProcess(order.pid, self)

    def _read(self, stream: IO[bytes], orders: deque[_Order], ready: threading.Event) -> None:
        try:
            with stream:
                for line in stream:
                    self._heard(line, orders, ready)
        finally:
            with self._lock:  # (it exited: no order of it is answered now)
                while orders:
                    orders.popleft().answered.set()

    def _heard(self, line: bytes, orders: deque[_Order], ready: threading.Event) -> None:
        word, _, rest = line.decode(errors="replace").strip().partition(" ")
        if word == "ready":
            ready.set()
            log.info("the fork server has done its imports: on-demand workers are forked")
        elif word in ("started", "failed"):
            with self._lock:
                order = orders.popleft() if orders else None
                if order is None:
                    return
                if word == "started" and rest.isdigit():
                    order.pid = int(rest)
                else:
                    order.failure = rest or "no reason given"
                if orders is self._orders and not orders:
                    self._stalled = False  # (it answers again)
                order.answered.set()
            if order.given_up and order.pid is not None:
                log.warning(
                    "the fork server forked %s (pid %d) after it was started as a process "
                    "of its own; killing that one",
                    order.name,
                    order.pid,
                )
                with contextlib.suppress(ProcessLookupError):
                    os.kill(order.pid, signal.SIGKILL)  # (it holds nothing yet)
        elif word == "exited":
            pid, _, code = rest.partition(" ")
            with contextlib.suppress(ValueError):
                self.exit_codes[int(pid)] = int(code)
                self.on_exit()

    def stop(self) -> None:
        """End the server, once ``sluice up`` stops: the supervisor has stopped its workers
        first (killing one still running after the stop grace) while the server reaped
        them; it stops those left itself (SIGTERM, then it waits 10 s and exits)."""
        process, self.process = self.process, None
        if process is None:
            return
        with contextlib.suppress(OSError):
            if process.stdin is not None:
                process.stdin.close()  # (end of input: it stops its workers and exits)
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        if self._reader is not None:
            self._reader.join(5)


@dataclass
class ForkedProcess:
    """A worker the fork server forked, as the supervisor handles a ``Popen``."""

    pid: int
    server: ForkServer

    def poll(self) -> int | None:
        code = self.server.exit_codes.get(self.pid)
        if code is None and not self.server.alive and not pid_alive(self.pid):
            return -signal.SIGTERM  # (its server died, and it with it)
        return code

    def terminate(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGTERM)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout or 0.0)
            time.sleep(0.01)
        return code
