"""What a worker process holds: measured, never declared.

Host memory is the process's unique set size: the pages only it holds (``Private_Clean`` and
``Private_Dirty`` of ``/proc/<pid>/smaps_rollup``), which is what unloading it gives back.
Pages it shares (the interpreter, onnxruntime's library, the imports its fork server did
for every worker, a model file mapped by several instances) stay whatever is unloaded, so
they are not a model's. Where ``smaps_rollup`` cannot be read, the resident set size
(``VmRSS``) is used instead.

GPU memory is read through NVML (``pynvml``, the ``gpu`` extra), per process and GPU; it is
imported only when a GPU budget is given, and a GPU budget without NVML is a start-up error.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from sluice.core.memory_budget import gpu_device

_PROC = Path("/proc")


def host_bytes(pid: int) -> int:
    """Bytes of host memory only the process holds (0 when it is gone)."""
    for name, keys in (("smaps_rollup", _PRIVATE), ("status", ("VmRSS:",))):
        try:
            text = (_PROC / str(pid) / name).read_text()
        except OSError:
            continue
        found = [int(line.split()[1]) for line in text.splitlines() if line.startswith(keys)]
        if found:
            return sum(found) * 1024  # kB
    return 0


_PRIVATE = ("Private_Clean:", "Private_Dirty:")


class NvmlMissing(RuntimeError):
    """A GPU budget was given, but NVML cannot be used here."""


@dataclass
class GpuMemory:
    """GPU memory per process, through NVML."""

    module: str = "pynvml"
    _nvml: ModuleType | None = None
    _handles: dict[int, Any] = field(default_factory=dict)

    def start(self, gpus: list[int]) -> None:
        """Load NVML and find ``gpus``; NvmlMissing says why not."""
        try:
            nvml = importlib.import_module(self.module)
            nvml.nvmlInit()
            count = int(nvml.nvmlDeviceGetCount())
        except Exception as exc:
            raise NvmlMissing(
                "SLUICE_GPU_MEMORY_BUDGET needs NVML (an NVIDIA driver and the nvidia-ml-py "
                f"package, pip install 'sluice[gpu]'): {exc}"
            ) from None
        missing = [gpu for gpu in gpus if not 0 <= gpu < count]
        if missing:
            raise NvmlMissing(
                f"SLUICE_GPU_MEMORY_BUDGET names GPU {missing[0]}; this host has {count}"
            )
        self._nvml = nvml
        self._handles = {gpu: nvml.nvmlDeviceGetHandleByIndex(gpu) for gpu in gpus}

    def by_process(self) -> dict[int, dict[str, int]]:
        """pid -> device -> bytes, over the GPUs with a budget (empty without NVML)."""
        nvml = self._nvml
        used: dict[int, dict[str, int]] = {}
        if nvml is None:
            return used
        for gpu, handle in self._handles.items():
            try:
                processes = nvml.nvmlDeviceGetComputeRunningProcesses(handle)
            except Exception:
                continue
            for process in processes:
                held = int(getattr(process, "usedGpuMemory", 0) or 0)
                device = used.setdefault(int(process.pid), {})
                device[gpu_device(gpu)] = device.get(gpu_device(gpu), 0) + held
        return used
