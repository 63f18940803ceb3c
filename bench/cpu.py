"""Per-component CPU time from ``/proc/<pid>/stat`` (Linux only).

A :class:`CpuMeter` follows a process tree (the ``sluice up`` process and all its
descendants, found afresh at every sample) plus the load generator itself, and
groups the processes by command line into gateway / worker / redis / other.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

GROUPS = ("gateway", "worker", "redis", "other", "loadgen")
_PROC = Path("/proc")
_TICKS_PER_SECOND = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass(frozen=True)
class ProcStat:
    pid: int
    ppid: int
    start_ticks: int  # with the pid, identifies a process across samples
    cpu_seconds: float  # utime + stime


def read_stat(pid: int) -> ProcStat | None:
    """Parse ``/proc/<pid>/stat``; None if the process is gone or unreadable."""
    try:
        text = (_PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    # The command name (field 2) is parenthesised and may contain spaces.
    fields = text[text.rindex(")") + 2 :].split()
    # fields[0] is field 3 (state): ppid is field 4, utime/stime 14/15, starttime 22.
    ticks = int(fields[11]) + int(fields[12])
    return ProcStat(pid, int(fields[1]), int(fields[19]), ticks / _TICKS_PER_SECOND)


def command_line(pid: int) -> str:
    try:
        raw = (_PROC / str(pid) / "cmdline").read_bytes()
    except OSError:
        return ""
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()


def classify(command: str) -> str:
    """gateway / worker / redis / other, from a command line.

    ``python -m sluice.gateway`` and ``python -m sluice.workers ...`` (or the ``sluice
    gateway`` and ``sluice worker`` commands) are recognised by module or sub-command, never
    by a keyword anywhere in the line (a repository path could contain one).
    """
    tokens = command.split()
    if not tokens:
        return "other"
    if "redis" in os.path.basename(tokens[0]) or "redis-server" in command:
        return "redis"
    # "python -m <module> [<command>]" or "<script> <command>"
    start = tokens.index("-m") + 1 if "-m" in tokens[:-1] else 0
    module = os.path.basename(tokens[start]).removeprefix("sluice.")
    words = {module.split(".")[0], *tokens[start + 1 : start + 2]}
    if words & {"gateway", "uvicorn"}:
        return "gateway"
    if words & {"workers", "worker"}:
        return "worker"
    return "other"


def tree(root: int) -> list[ProcStat]:
    """``root`` and all its live descendants."""
    stats: dict[int, ProcStat] = {}
    for entry in _PROC.iterdir():
        if entry.name.isdigit() and (stat := read_stat(int(entry.name))) is not None:
            stats[stat.pid] = stat
    children: dict[int, list[int]] = {}
    for stat in stats.values():
        children.setdefault(stat.ppid, []).append(stat.pid)
    found: list[ProcStat] = []
    pending = [root] if root in stats else []
    while pending:
        pid = pending.pop()
        found.append(stats[pid])
        pending.extend(children.get(pid, ()))
    return found


Sample = dict[tuple[int, int], tuple[str, float]]  # (pid, start) -> (group, cpu seconds)


class CpuMeter:
    """CPU seconds per group between :meth:`start` and :meth:`stop`."""

    def __init__(self, stack_pid: int | None, more_roots: tuple[int, ...] = ()) -> None:
        """``more_roots``: other process trees to follow beside ``stack_pid``'s (a
        deployment spread over several processes started apart, such as test hosts)."""
        self.stack_pid = stack_pid
        self.roots = ((stack_pid,) if stack_pid is not None else ()) + more_roots
        self._groups: dict[tuple[int, int], str] = {}  # command lines, read once per process
        self._start: Sample = {}
        self.last: dict[str, float] | None = None  # CPU seconds per group, last window

    def sample(self) -> Sample:
        processes = [stat for root in self.roots for stat in tree(root)]
        sample: Sample = {}
        for stat in processes:
            key = (stat.pid, stat.start_ticks)
            if key not in self._groups:
                self._groups[key] = classify(command_line(stat.pid))
            sample[key] = (self._groups[key], stat.cpu_seconds)
        own = read_stat(os.getpid())
        if own is not None:
            sample[(own.pid, own.start_ticks)] = ("loadgen", own.cpu_seconds)
        return sample

    def start(self) -> None:
        self._start = self.sample()
        self.last = None

    def stop(self) -> dict[str, float]:
        """CPU seconds per group since :meth:`start` (processes born since count in full)."""
        totals = dict.fromkeys(GROUPS, 0.0)
        for key, (group, seconds) in self.sample().items():
            totals[group] += seconds - self._start.get(key, (group, 0.0))[1]
        self.last = totals
        return totals

    def on_window(self, opening: bool) -> None:
        """A :data:`bench.loadgen.WindowHook`: measure exactly the load's measured window."""
        if opening:
            self.start()
        else:
            self.stop()

    def group_counts(self) -> dict[str, int]:
        """How many processes of each group there are now (for the report)."""
        counts = dict.fromkeys(GROUPS, 0)
        for group, _ in self.sample().values():
            counts[group] += 1
        return counts

    def idle_percent(self, seconds: float = 1.0) -> dict[str, float]:
        """CPU use of each stack group (percent of one core) while nothing is sent."""
        self.start()
        time.sleep(seconds)
        totals = self.stop()
        return {group: 100.0 * totals[group] / seconds for group in GROUPS if group != "loadgen"}
