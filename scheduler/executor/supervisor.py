"""Boring process supervision: start children, reap the dead, respawn with back-off.

A child that exits with a permanent-failure status (a model that cannot load) is started
again at once only as many times as ``load_retries`` allows (Triton's
--model-load-retry-count), then no more. A child that ran healthily for a while and then
died is restarted at once; one that keeps dying soon after its start is restarted with a
growing delay.

Every child asked to stop gets SIGTERM, and SIGKILL if it has not exited once its grace
has passed (:mod:`.leaving`): a worker retired (its model unloaded or replaced, scaled down)
after ``stop_grace_s`` (``SLUICE_WORKER_STOP_GRACE_S``), the workers of a load abandoned at
its deadline at once. Stopping asks every child: the workers get the same grace, the other
children (a gateway finishing its requests) their own time (:func:`gateway_stop_s`).

A child that cannot even be started (``fork`` or ``exec`` fails: out of processes or
memory) counts as one that exited at once (:data:`COULD_NOT_START`): it is started again
with the same back-off, and a worker loading on demand is refused after as many tries as
one that keeps dying.
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
from sluice.scheduler.executor.leaving import LeavingWorkers

log = logging.getLogger(__name__)

_MAX_BACKOFF_S = 30.0
LOAD_RETRIES_LEFT = "SLUICE_LOAD_RETRIES_LEFT"
HEALTHY_AFTER_S = 10.0
"""A child that ran this long before it exited was healthy: its back-off starts over."""
STOP_GRACE_S = 30.0
"""How long a worker asked to stop has to exit before it is killed (the default of
``SLUICE_WORKER_STOP_GRACE_S``, as Triton's ``--exit-timeout-secs``)."""
SHUTDOWN_TIMEOUT_S = 10.0
"""The default of ``SLUICE_SHUTDOWN_TIMEOUT_S``: how long a stopping gateway drains."""
STOP_MARGIN_S = 5.0
"""What a stopping gateway has beyond its drain to close up (its gRPC server, its reply
reader, the spans it still buffers) and exit before it is killed."""
COULD_NOT_START = 127
"""The exit status recorded for a child that could not be started (as a shell's)."""
_MIN_START_RETRY_S = 0.5
"""The least a start that failed waits for its next try (the first restart after an exit
is immediate; a start that failed would fail again at once)."""
_KILLED_EXIT_S = 5.0
"""How long a stop waits for a killed child to be gone (one stuck in the kernel may not)."""


def gateway_stop_s(shutdown_timeout_s: float = SHUTDOWN_TIMEOUT_S) -> float:
    """How long the children other than workers (gateways, batch workers) have to exit when
    everything stops before they are killed: a gateway's drain (``shutdown_timeout_s``,
    Triton's ``--exit-timeout-secs``) and :data:`STOP_MARGIN_S`."""
    return shutdown_timeout_s + STOP_MARGIN_S


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
        stop_grace_s: float = STOP_GRACE_S,
        others_stop_s: float = gateway_stop_s(SHUTDOWN_TIMEOUT_S),
    ) -> None:
        self._healthy_after_s = healthy_after_s
        self.others_stop_s = others_stop_s
        """How long the other children have to exit when everything stops."""
        self.load_retries = load_retries
        """How many times a child that exited with a permanent-failure status is started
        again before it counts as failed."""
        self.children = [Child(spec, backoff=Backoff(healthy_after_s)) for spec in specs]
        self.leaving = LeavingWorkers(stop_grace_s)
        """The children asked to stop that have not exited yet."""
        self._stopping = False

    @property
    def busy(self) -> bool:
        """A child waits to be restarted (after its back-off), or one asked to stop has not
        exited yet (it is killed on time): tick often until then."""
        return not self._stopping and (
            bool(self.leaving)
            or any(c.process is None and not (c.failed or c.retiring) for c in self.children)
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
        now = time.monotonic()
        try:
            process = subprocess.Popen(
                list(child.spec.argv),
                env=self.prepared(child.spec, tries).env,
                stdout=sys.stderr.fileno(),
                start_new_session=True,
                preexec_fn=die_with_parent,
                pass_fds=child.spec.pass_fds,
            )
        except (OSError, subprocess.SubprocessError) as exc:
            child.exit_codes.append(COULD_NOT_START)
            delay = child.backoff.delay_after(0.0)
            child.restart_at = now + max(delay, _MIN_START_RETRY_S)
            log.error(
                "%s could not be started (%s); trying again in %.1f s",
                child.spec.name,
                exc,
                child.restart_at - now,
            )
            return
        child.process, child.started_at = process, now
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

    def retire(self, children: Sequence[Child], grace_s: float | None = None) -> None:
        """Ask ``children`` to stop (SIGTERM: a worker answers what it holds first); one
        still running ``grace_s`` later (by default the stop grace) is killed, on a later
        :meth:`tick`. ``grace_s`` 0 kills them now (a load abandoned at its deadline). They
        are not restarted and leave :attr:`children` once they have exited."""
        for child in children:
            child.retiring = True
            if child.running and grace_s != 0:
                assert child.process is not None
                child.process.terminate()
        self.leaving.add(children, grace_s)

    def tick(self) -> None:
        """Reap exited children and respawn those due; call periodically."""
        if self._stopping:
            return
        now = time.monotonic()
        self.leaving.sweep(now)
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

    def stop(self, timeout_s: float | None = None) -> None:
        """Stop every child and wait until they have exited: a worker is killed once the
        stop grace has passed, any other child after ``timeout_s`` (by default
        :attr:`others_stop_s`)."""
        timeout_s = self.others_stop_s if timeout_s is None else timeout_s
        self._stopping = True
        live = [c for c in self.children if c.running]
        self.retire([c for c in live if c.spec.version is not None])
        self.retire([c for c in live if c.spec.version is None], timeout_s)
        give_up = time.monotonic() + max(self.leaving.grace_s, timeout_s) + _KILLED_EXIT_S
        while self.leaving and time.monotonic() < give_up:
            time.sleep(0.02)
            self.leaving.sweep()
        for child in [c for c in live if c.running]:
            assert child.process is not None
            log.error(
                "%s (pid %d) is still running after SIGKILL", child.spec.name, child.process.pid
            )
