"""Triton's ``nv_cpu_*`` gauges for this host, from /proc (Linux)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


def escape_label(value: str) -> str:
    """A label value as Prometheus' text format writes it."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def family(lines: list[str], name: str, help_text: str, kind: str) -> None:
    """The HELP and TYPE lines of a metric family."""
    lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]


@dataclass
class HostUsage:
    """Triton's ``nv_cpu_*`` gauges for this host, from /proc (Linux)."""

    proc: Path = Path("/proc")
    _last: tuple[int, int] | None = field(default=None, init=False)

    def lines(self) -> list[str]:
        lines: list[str] = []
        utilization = self.cpu_utilization()
        if utilization is not None:
            family(lines, "nv_cpu_utilization", "CPU utilization rate [0.0 - 1.0]", "gauge")
            lines.append(f"nv_cpu_utilization {utilization:.6f}")
        memory = self._memory()
        if memory is not None:
            total, used = memory
            family(lines, "nv_cpu_memory_total_bytes", "CPU total memory (RAM), in bytes", "gauge")
            lines.append(f"nv_cpu_memory_total_bytes {total}")
            family(lines, "nv_cpu_memory_used_bytes", "CPU used memory (RAM), in bytes", "gauge")
            lines.append(f"nv_cpu_memory_used_bytes {used}")
        return lines

    def cpu_utilization(self) -> float | None:
        """Busy share of all CPUs since the previous scrape (since boot at the first)."""
        try:
            fields = (self.proc / "stat").read_text().split("\n", 1)[0].split()[1:]
        except OSError:
            return None
        ticks = [int(value) for value in fields]
        idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle + iowait
        total = sum(ticks[:8])
        last_idle, last_total = self._last or (0, 0)
        self._last = (idle, total)
        elapsed = total - last_total
        return 0.0 if elapsed <= 0 else max(0.0, min(1.0, 1 - (idle - last_idle) / elapsed))

    def _memory(self) -> tuple[int, int] | None:
        info = meminfo(self.proc)
        if info is None:
            return None
        total, available = info.get("MemTotal"), info.get("MemAvailable")
        if total is None or available is None:
            return None
        return total, total - available


def meminfo(proc: Path = Path("/proc")) -> dict[str, int] | None:
    """``/proc/meminfo`` in bytes by field name; None where it cannot be read."""
    try:
        return dict(_meminfo_line(line) for line in (proc / "meminfo").read_text().splitlines())
    except (OSError, ValueError, IndexError):
        return None


def _meminfo_line(line: str) -> tuple[str, int]:
    name, _, rest = line.partition(":")
    parts = rest.split()
    return name, int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)


HOST = HostUsage()
