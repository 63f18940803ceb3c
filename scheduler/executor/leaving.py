"""Children asked to stop, followed until they are gone: one rule for every retirement.

A worker asked to stop (SIGTERM: its model unloaded or replaced, scaled down, unloaded on
demand to make room, or ``sluice up`` stopping) answers what it holds and exits. One that
does not (it ignores SIGTERM, or hangs in its model's code) would keep its memory, and a
GPU's, for good: once ``grace_s`` has passed it is killed (SIGKILL). The grace is
``SLUICE_WORKER_STOP_GRACE_S``; the supervisor follows every child it retires
(:meth:`.supervisor.Supervisor.retire`). A load abandoned at its deadline gives no grace:
its workers hold no request, and a worker stuck in its model's loading does not end on
SIGTERM (it waits for the loading thread).

Until a worker has exited, what it holds is in use (:func:`footprint`): read from the
process itself (its private host memory, and its GPU memory where a GPU budget is
measured), not what its version was last measured to hold. A killed worker counts until it
is gone, as a process stuck in the kernel keeps its memory until then.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from sluice.core.memory_budget import HOST
from sluice.scheduler.executor.process_memory import host_bytes

if TYPE_CHECKING:  # (the supervisor follows its children with this module)
    from sluice.scheduler.executor.supervisor import Child

log = logging.getLogger("sluice.up")


@dataclass
class _Departure:
    child: Child
    grace_s: float
    kill_at: float
    killed: bool = False


@dataclass
class LeavingWorkers:
    grace_s: float
    """How long a child asked to stop has to exit before it is killed."""
    _departures: list[_Departure] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self._departures)

    def __len__(self) -> int:
        return len(self._departures)

    def add(self, children: Iterable[Child], grace_s: float | None = None) -> None:
        """Follow ``children``, asked to stop already, until they have exited: killed once
        ``grace_s`` (by default this one's) has passed; 0 kills them now. A child followed
        already keeps the earlier of its two deadlines."""
        now = time.monotonic()
        grace = self.grace_s if grace_s is None else grace_s
        for child in children:
            if not child.running:
                continue
            followed = next((d for d in self._departures if d.child is child), None)
            if followed is None:
                self._departures.append(_Departure(child, grace, now + grace))
            elif now + grace < followed.kill_at:
                followed.grace_s, followed.kill_at = grace, now + grace
        self.sweep(now)

    def sweep(self, now: float | None = None) -> None:
        """Forget the children that have exited; kill those past their grace."""
        now = time.monotonic() if now is None else now
        kept: list[_Departure] = []
        for departure in self._departures:
            if not departure.child.running:
                continue
            if not departure.killed and now >= departure.kill_at:
                _kill(departure)
            kept.append(departure)
        self._departures = kept


def footprint(children: Iterable[Child], gpu: Mapping[int, Mapping[str, int]]) -> dict[str, int]:
    """What those of ``children`` that have not exited hold, by device; ``gpu``: pid ->
    device -> bytes (:meth:`.process_memory.GpuMemory.by_process`)."""
    held: dict[str, int] = {}
    for child in children:
        process = child.process
        if process is None or not child.running:
            continue
        held[HOST] = held.get(HOST, 0) + host_bytes(process.pid)
        for device, size in gpu.get(process.pid, {}).items():
            held[device] = held.get(device, 0) + size
    return held


def _kill(departure: _Departure) -> None:
    process = departure.child.process
    assert process is not None
    departure.killed = True
    if departure.grace_s > 0:
        log.warning(
            "%s (pid %d) did not exit within %g s of SIGTERM; killing it (SIGKILL)",
            departure.child.spec.name,
            process.pid,
            departure.grace_s,
        )
    process.kill()
