"""Triton's GPU gauges through NVML, where a GPU and the NVML bindings exist.

``pynvml`` (the ``nvidia-ml-py`` package, in the ``gpu`` extra) is imported at the first
scrape, not before; without it, or without a GPU or driver, the families are left out, as
Triton leaves them out when it finds no GPU. Labels are Triton's: ``gpu_uuid``.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from sluice.gateway.metrics.host import family

log = logging.getLogger(__name__)

GPU_FAMILIES = (
    "nv_gpu_utilization",
    "nv_gpu_memory_total_bytes",
    "nv_gpu_memory_used_bytes",
    "nv_gpu_power_usage",
    "nv_gpu_power_limit",
    "nv_energy_consumption",
)
_HELP = {
    "nv_gpu_utilization": ("GPU utilization rate [0.0 - 1.0)", "gauge"),
    "nv_gpu_memory_total_bytes": ("GPU total memory, in bytes", "gauge"),
    "nv_gpu_memory_used_bytes": ("GPU used memory, in bytes", "gauge"),
    "nv_gpu_power_usage": ("GPU power usage in watts", "gauge"),
    "nv_gpu_power_limit": ("GPU power management limit in watts", "gauge"),
    "nv_energy_consumption": (
        "GPU energy consumption in joules since the Triton Server started",
        "counter",
    ),
}


@dataclass
class GpuUsage:
    module: str = "pynvml"
    _nvml: ModuleType | None = None
    _tried: bool = False
    _energy_start: dict[str, float] | None = None

    def _load(self) -> ModuleType | None:
        if not self._tried:
            self._tried = True
            try:
                nvml = importlib.import_module(self.module)
                nvml.nvmlInit()
                self._nvml = nvml
            except Exception as exc:  # no bindings, no driver, no GPU: no GPU metrics
                log.debug("no GPU metrics: %s", exc)
        return self._nvml

    def devices(self) -> list[dict[str, Any]]:
        """Each GPU's readings, in NVML's index order; none without NVML or a GPU."""
        nvml = self._load()
        if nvml is None:
            return []
        try:
            return [_sample(nvml, index) for index in range(nvml.nvmlDeviceGetCount())]
        except Exception as exc:
            log.warning("reading GPU metrics failed: %s", exc)
            return []

    def lines(self) -> list[str]:
        samples = self.devices()
        if not samples:
            return []
        if self._energy_start is None:
            self._energy_start = {s["uuid"]: s["energy"] for s in samples}
        lines: list[str] = []
        for name in GPU_FAMILIES:
            family(lines, name, *_HELP[name])
            for sample in samples:
                value = (
                    sample[name]
                    if name != "nv_energy_consumption"
                    else (sample["energy"] - self._energy_start.get(sample["uuid"], 0.0))
                )
                lines.append(f'{name}{{gpu_uuid="{sample["uuid"]}"}} {value}')
        return lines


def _sample(nvml: Any, index: int) -> dict[str, Any]:
    handle = nvml.nvmlDeviceGetHandleByIndex(index)
    uuid = nvml.nvmlDeviceGetUUID(handle)
    memory = nvml.nvmlDeviceGetMemoryInfo(handle)
    return {
        "uuid": uuid.decode() if isinstance(uuid, bytes) else str(uuid),
        "nv_gpu_utilization": nvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100,
        "nv_gpu_memory_total_bytes": memory.total,
        "nv_gpu_memory_used_bytes": memory.used,
        "nv_gpu_power_usage": nvml.nvmlDeviceGetPowerUsage(handle) / 1000,  # mW
        "nv_gpu_power_limit": nvml.nvmlDeviceGetPowerManagementLimit(handle) / 1000,
        "energy": nvml.nvmlDeviceGetTotalEnergyConsumption(handle) / 1000,  # mJ
    }


GPUS = GpuUsage()
