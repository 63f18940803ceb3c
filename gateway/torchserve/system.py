"""TorchServe's host gauges on its metrics port, as TorchServe's frontend reports them.

TorchServe's Prometheus text carries, beside its request families, the host's
``CPUUtilization``, ``MemoryUsed``, ``MemoryAvailable``, ``MemoryUtilization``,
``DiskUsage``, ``DiskAvailable`` and ``DiskUtilization`` (labels ``Level="Host"`` and
``Hostname``; megabytes, gigabytes and percents). TorchServe reads them with psutil; here
they come from ``/proc`` and ``statvfs`` with psutil's definitions, so a dashboard built on
TorchServe's numbers reads the same ones:

- memory used is the memory not available (``MemTotal`` less ``MemAvailable``, as psutil
  and ``free`` count it now), and utilization its share of the total;
- disk figures are those of the root file system; available is what an unprivileged user
  may still write, and utilization counts used against used plus that;
- CPU utilization is the busy share of all CPUs since this port's previous scrape (since
  boot at the first).

With a GPU (NVML, as Triton's ``nv_gpu_*`` read it), ``GPUUtilization``, ``GPUMemoryUsed``
and ``GPUMemoryUtilization`` too, per ``device_id``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from sluice.gateway.metrics.gpu import GPUS, GpuUsage
from sluice.gateway.metrics.host import HostUsage, escape_label, family, meminfo

_MB, _GB = 1024**2, 1024**3
_UNITS = {"percent": "Percent", "MB": "Megabytes", "GB": "Gigabytes"}


@dataclass
class SystemGauges:
    proc: Path = Path("/proc")
    disk: str = "/"
    gpus: GpuUsage = field(default_factory=lambda: GPUS)
    _cpu: HostUsage = field(init=False)

    def __post_init__(self) -> None:
        self._cpu = HostUsage(self.proc)

    def readings(self) -> dict[str, tuple[float, str]]:
        """Gauge name -> (value, TorchServe's unit); a reading the host cannot give is left
        out."""
        found: dict[str, tuple[float, str]] = {}
        busy = self._cpu.cpu_utilization()
        if busy is not None:
            found["CPUUtilization"] = (round(busy * 100, 1), "percent")
        memory = meminfo(self.proc)
        if memory is not None and memory.get("MemTotal"):
            total = memory["MemTotal"]
            available = min(total, memory.get("MemAvailable", memory.get("MemFree", 0)))
            found["MemoryUsed"] = (float(total - available) / _MB, "MB")
            found["MemoryAvailable"] = (available / _MB, "MB")
            found["MemoryUtilization"] = (_percent(total - available, total), "percent")
        try:
            disk = os.statvfs(self.disk)
        except OSError:
            return found
        used = (disk.f_blocks - disk.f_bfree) * disk.f_frsize
        available = disk.f_bavail * disk.f_frsize
        found["DiskUsage"] = (used / _GB, "GB")
        found["DiskAvailable"] = (available / _GB, "GB")
        found["DiskUtilization"] = (_percent(used, used + available), "percent")
        return found

    def gpu_readings(self) -> dict[str, tuple[list[tuple[int, float]], str]]:
        """GPU gauge name -> ([(device id, value)], unit); empty without a GPU."""
        devices = self.gpus.devices()
        if not devices:
            return {}
        used = [d["nv_gpu_memory_used_bytes"] for d in devices]
        total = [d["nv_gpu_memory_total_bytes"] for d in devices]
        return {
            "GPUUtilization": (
                [(i, round(d["nv_gpu_utilization"] * 100, 1)) for i, d in enumerate(devices)],
                "percent",
            ),
            "GPUMemoryUsed": ([(i, u / _MB) for i, u in enumerate(used)], "MB"),
            "GPUMemoryUtilization": (
                [(i, _percent(u, t)) for i, (u, t) in enumerate(zip(used, total, strict=True))],
                "percent",
            ),
        }

    def lines(self, hostname: str, wanted: frozenset[str] = frozenset()) -> list[str]:
        """The gauges in TorchServe's Prometheus text (only those in ``wanted``, when it
        names any)."""
        host = escape_label(hostname)
        lines: list[str] = []
        for name, (value, unit) in self.readings().items():
            if not wanted or name in wanted:
                _family(lines, name, unit)
                lines.append(f'{name}{{Level="Host",Hostname="{host}",}} {float(value)}')
        for name, (values, unit) in self.gpu_readings().items():
            if not wanted or name in wanted:
                _family(lines, name, unit)
                for device, reading in values:
                    labels = f'Level="Host",device_id="{device}",Hostname="{host}",'
                    lines.append(f"{name}{{{labels}}} {float(reading)}")
        return lines


def _family(lines: list[str], name: str, unit: str) -> None:
    help_text = f"Torchserve prometheus gauge metric with unit: {_UNITS[unit]}"
    family(lines, name, help_text, "gauge")


def _percent(part: float, whole: float) -> float:
    return round(part / whole * 100, 1) if whole > 0 else 0.0
