"""A stand-in ``pynvml`` module for the GPU gauges' tests (no GPU here)."""

from __future__ import annotations

from types import ModuleType, SimpleNamespace
from typing import Any


class FakeNvml(ModuleType):
    """One GPU: 42 % busy, 1 GiB of 80 GiB used, 150 W of 700 W."""

    def __init__(self) -> None:
        super().__init__("fake_nvml")
        self.energy_mj = 5_000_000

    def nvmlInit(self) -> None: ...

    def nvmlDeviceGetCount(self) -> int:
        return 1

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetUUID(self, handle: int) -> bytes:
        return b"GPU-1234"

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> Any:
        return SimpleNamespace(total=80 << 30, used=1 << 30)

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> Any:
        return SimpleNamespace(gpu=42)

    def nvmlDeviceGetPowerUsage(self, handle: int) -> int:
        return 150_000

    def nvmlDeviceGetPowerManagementLimit(self, handle: int) -> int:
        return 700_000

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: int) -> int:
        return self.energy_mj
