"""Boring process supervision: start children, reap the dead, respawn with back-off.

A child that exits with a permanent-failure status (a model that cannot load)
is not respawned. Stopping sends SIGTERM to all, waits, then kills the rest.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_MAX_BACKOFF_S = 30.0


def _die_with_parent() -> None:
    """Children get SIGTERM when the supervisor dies, even by SIGKILL (Linux)."""
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass(frozen=True, slots=True)
class ChildSpec:
    name: str
    argv: Sequence[str]
    env: dict[str, str]
    permanent_exit_codes: frozenset[int] = frozenset()
    pass_fds: tuple[int, ...] = ()


@dataclass
class Child:
    spec: ChildSpec
    process: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    restart_at: float = 0.0
    failed: bool = False
    exit_codes: list[int] = field(default_factory=list)

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None


class Supervisor:
    def __init__(self, specs: Sequence[ChildSpec]) -> None:
        self.children = [Child(spec) for spec in specs]
        self._stopping = False

    def _spawn(self, child: Child) -> None:
        child.process = subprocess.Popen(
            list(child.spec.argv),
            env=child.spec.env,
            stdout=sys.stderr.fileno(),
            start_new_session=True,
            preexec_fn=_die_with_parent,
            pass_fds=child.spec.pass_fds,
        )
        log.info("started %s (pid %d)", child.spec.name, child.process.pid)

    def start(self) -> None:
        for child in self.children:
            self._spawn(child)

    def tick(self) -> None:
        """Reap exited children and respawn those due; call periodically."""
        if self._stopping:
            return
        now = time.monotonic()
        for child in self.children:
            if child.failed:
                continue
            if child.process is not None:
                code = child.process.poll()
                if code is None:
                    continue
                child.exit_codes.append(code)
                child.process = None
                if code in child.spec.permanent_exit_codes:
                    child.failed = True
                    log.error(
                        "%s cannot start (exit status %d); not restarting it", child.spec.name, code
                    )
                    continue
                delay = min(_MAX_BACKOFF_S, 0.5 * 2**child.restarts)
                child.restart_at = now + delay
                child.restarts += 1
                log.warning(
                    "%s exited with status %d; restarting in %.1f s", child.spec.name, code, delay
                )
            elif now >= child.restart_at:
                self._spawn(child)

    def stop(self, timeout_s: float = 15.0) -> None:
        self._stopping = True
        live = [
            c.process for c in self.children if c.process is not None and c.process.poll() is None
        ]
        for process in live:
            process.terminate()
        deadline = time.monotonic() + timeout_s
        for process in live:
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
