"""Boring process supervision: start children, reap the dead, respawn with back-off.

A child that exits with a permanent-failure status (a model that cannot load) is started
again at once only as many times as ``load_retries`` allows (Triton's
--model-load-retry-count), then no more. A child that ran healthily for a while and then
died is restarted at once; one that keeps dying soon after its start is restarted with a
growing delay.
Stopping sends SIGTERM to all, waits, then kills the rest.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

from sluice.core.runtime import die_with_parent

log = logging.getLogger(__name__)

_MAX_BACKOFF_S = 30.0
LOAD_RETRIES_LEFT = "SLUICE_LOAD_RETRIES_LEFT"
HEALTHY_AFTER_S = 10.0
"""A child that ran this long before it exited was healthy: its back-off starts over."""


@dataclass
class Backoff:
    """Restart delays: none for the first exit after a healthy run, then 0.5, 1, 2 ... s
    (at most 30 s) while the process keeps exiting within ``healthy_after_s`` of its start."""

    healthy_after_s: float = HEALTHY_AFTER_S
    failures: int = 0

    def delay_after(self, ran_for_s: float) -> float:
        if ran_for_s >= self.healthy_after_s:
            self.failures = 0
        delay = 0.0 if self.failures == 0 else min(_MAX_BACKOFF_S, 0.25 * 2**self.failures)
        self.failures += 1
        return delay


@dataclass(frozen=True, slots=True)
class ChildSpec:
    name: str
    argv: Sequence[str]
    env: dict[str, str]
    permanent_exit_codes: frozenset[int] = frozenset()
    pass_fds: tuple[int, ...] = ()
    version: int | None = None
    """The model version a worker serves (None for other children)."""


class Process(Protocol):
    """What the supervisor needs of a child: a ``Popen``, or a worker a fork server forked
    (:mod:`.fork_server`)."""

    pid: int

    def poll(self) -> int | None: ...

    def terminate(self) -> None: ...

    def kill(self) -> None: ...

    def wait(self, timeout: float | None = None) -> int: ...


@dataclass
class Child:
    spec: ChildSpec
    process: Process | None = None
    backoff: Backoff = field(default_factory=Backoff)
    started_at: float = 0.0
    restart_at: float = 0.0
    failed: bool = False
    retiring: bool = False
    """Asked to stop for good (its model was unloaded or replaced): not restarted."""
    exit_codes: list[int] = field(default_factory=list)

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None


class Supervisor:
    def __init__(
        self,
        specs: Sequence[ChildSpec],
        *,
        healthy_after_s: float = HEALTHY_AFTER_S,
        load_retries: int = 0,
    ) -> None:
        self._healthy_after_s = healthy_after_s
        self.load_retries = load_retries
        """How many times a child that exited with a permanent-failure status is started
        again before it counts as failed."""
        self.children = [Child(spec, backoff=Backoff(healthy_after_s)) for spec in specs]
        self._stopping = False

    @property
    def busy(self) -> bool:
        """A child waits to be restarted (after its back-off): tick often until it is."""
        return not self._stopping and any(
            c.process is None and not (c.failed or c.retiring) for c in self.children
        )

    def prepared(self, spec: ChildSpec, tries: int = 0) -> ChildSpec:
        """``spec`` as started after ``tries`` failed loads: a worker learns how many
        retries it has left (``SLUICE_LOAD_RETRIES_LEFT``)."""
        if not spec.permanent_exit_codes:
            return spec
        left = str(max(0, self.load_retries - tries))
        return replace(spec, env={**spec.env, LOAD_RETRIES_LEFT: left})

    def _spawn(self, child: Child) -> None:
        permanent = child.spec.permanent_exit_codes
        tries = sum(1 for code in child.exit_codes if code in permanent)
        process = subprocess.Popen(
            list(child.spec.argv),
            env=self.prepared(child.spec, tries).env,
            stdout=sys.stderr.fileno(),
            start_new_session=True,
            preexec_fn=die_with_parent,
            pass_fds=child.spec.pass_fds,
        )
        child.process, child.started_at = process, time.monotonic()
        log.info("started %s (pid %d)", child.spec.name, process.pid)

    def start(self) -> None:
        for child in self.children:
            self._spawn(child)

    def add(self, specs: Sequence[ChildSpec]) -> list[Child]:
        """Start more children (a model loaded while running); returns them."""
        added = [Child(spec, backoff=Backoff(self._healthy_after_s)) for spec in specs]
        self.children += added
        for child in added:
            self._spawn(child)
        return added

    def adopt(self, spec: ChildSpec, process: Process) -> Child:
        """Supervise ``process``, started elsewhere as ``spec`` (forked by the fork server):
        restarted from ``spec`` if it dies."""
        child = Child(spec, process, Backoff(self._healthy_after_s), started_at=time.monotonic())
        self.children.append(child)
        log.info("started %s (pid %d, forked)", spec.name, process.pid)
        return child

    def retire(self, children: Sequence[Child]) -> None:
        """Ask ``children`` to stop (SIGTERM: a worker answers what it holds first); they
        are not restarted and leave :attr:`children` once they have exited."""
        for child in children:
            child.retiring = True
            if child.running:
                assert child.process is not None
                child.process.terminate()

    def tick(self) -> None:
        """Reap exited children and respawn those due; call periodically."""
        if self._stopping:
            return
        now = time.monotonic()
        self.children = [c for c in self.children if not (c.retiring and not c.running)]
        for child in self.children:
            if child.failed or child.retiring:
                continue
            if child.process is not None:
                code = child.process.poll()
                if code is None:
                    continue
                child.exit_codes.append(code)
                child.process = None
                permanent = child.spec.permanent_exit_codes
                if code in permanent:
                    tries = sum(1 for c in child.exit_codes if c in permanent)
                    if tries > self.load_retries:
                        child.failed = True
                        log.error(
                            "%s cannot start (exit status %d); not restarting it",
                            child.spec.name,
                            code,
                        )
                        continue
                    log.warning(
                        "%s cannot start (exit status %d); retrying (%d of %d)",
                        child.spec.name,
                        code,
                        tries,
                        self.load_retries,
                    )
                    child.restart_at = now
                else:
                    delay = child.backoff.delay_after(now - child.started_at)
                    child.restart_at = now + delay
                    log.warning(
                        "%s exited with status %d; restarting it%s",
                        child.spec.name,
                        code,
                        f" in {delay:.1f} s" if delay else "",
                    )
            if child.process is None and now >= child.restart_at:
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
