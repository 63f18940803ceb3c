"""Workers forked from one process that has done their imports, for on-demand loads.

Starting a worker costs about a second of CPU here before it reads its model, nearly all of
it Python importing numpy, onnxruntime and Sluice's worker. The fork server
(``python -m sluice.workers --fork-server``) does that once and forks a worker for each load:
the worker starts in milliseconds, with only its model left to read, and the imported
pages stay shared between the workers until one writes to them. A load then costs tens of
milliseconds of CPU instead of a second, so a host can load several models a second.

The executor orders a worker with one JSON line on the server's stdin and reads
``started <pid>``; the server, the only one that can wait for its children, reports
``exited <pid> <status>``. :class:`ForkedProcess` gives the supervisor what it needs of a
``Popen`` (poll, terminate, kill, wait). If such a worker dies, the supervisor starts it
again the ordinary way, from its arguments. If the server dies, its workers get SIGTERM
(they die with their parent) and the next load starts a new server.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO

from sluice.core.runtime import die_with_parent, pid_alive
from sluice.scheduler.executor.supervisor import ChildSpec

log = logging.getLogger("sluice.up")

FORK_SERVER_ARGV = (sys.executable, "-m", "sluice.workers", "--fork-server")
_WORKER_ARGS_FROM = 3
"""A worker spec's argv is ``python -m sluice.workers <arguments>``."""
_STARTED_WITHIN_S = 10.0


@dataclass
class ForkServer:
    env: dict[str, str]
    on_exit: Callable[[], None] = lambda: None
    """Called when a forked worker exits (wakes the executor's tick loop)."""
    process: subprocess.Popen[bytes] | None = None
    exit_codes: dict[int, int] = field(default_factory=dict)
    _started: queue.Queue[int] = field(default_factory=queue.Queue)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _reader: threading.Thread | None = None

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def ensure(self) -> None:
        """Start the server unless it runs (it does its imports meanwhile)."""
        if self.alive:
            return
        self.process = subprocess.Popen(
            list(FORK_SERVER_ARGV),
            env=self.env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
        self._started = queue.Queue()
        assert self.process.stdout is not None
        self._reader = threading.Thread(
            target=self._read, args=(self.process.stdout,), name="fork-server", daemon=True
        )
        self._reader.start()

    def spawn(self, spec: ChildSpec) -> ForkedProcess | None:
        """The worker of ``spec``, forked; None where the server cannot (start it the
        ordinary way then)."""
        is_worker = list(spec.argv[1:_WORKER_ARGS_FROM]) == ["-m", "sluice.workers"]
        if not self.alive or not is_worker or spec.pass_fds:
            return None
        assert self.process is not None and self.process.stdin is not None
        order = {"argv": list(spec.argv[_WORKER_ARGS_FROM:]), "env": spec.env}
        with self._lock:
            try:
                self.process.stdin.write(json.dumps(order).encode() + b"\n")
                self.process.stdin.flush()
                pid = self._started.get(timeout=_STARTED_WITHIN_S)
            except (OSError, queue.Empty) as exc:
                log.warning("the fork server could not start %s: %s", spec.name, exc or "no pid")
                self.stop()
                return None
        return ForkedProcess(pid, self)

    def _read(self, stream: IO[bytes]) -> None:
        with stream:
            for line in stream:
                self._heard(line)

    def _heard(self, line: bytes) -> None:
        word, _, rest = line.decode(errors="replace").strip().partition(" ")
        if word == "started" and rest.isdigit():
            self._started.put(int(rest))
        elif word == "exited":
            pid, _, code = rest.partition(" ")
            with contextlib.suppress(ValueError):
                self.exit_codes[int(pid)] = int(code)
                self.on_exit()

    def stop(self) -> None:
        """End the server. When ``sluice up`` stops, the supervisor has stopped its workers
        first (killing one still running after the stop grace) while the server reaped
        them. Otherwise (it could not start a worker) the server stops those left itself:
        SIGTERM, then it waits 10 s and exits; one that outlives it is still supervised by
        its pid, and killed after the grace once it is retired (:mod:`.leaving`)."""
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
