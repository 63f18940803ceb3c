"""TorchServe's host gauges (sluice.gateway.torchserve.system) from a /proc of the test's
own, and against psutil's readings of this host (TorchServe reads them with psutil)."""

from __future__ import annotations

import sys
from pathlib import Path

import psutil
import pytest

from sluice.gateway.metrics.gpu import GpuUsage
from sluice.gateway.torchserve.system import SystemGauges
from tests.support.fake_nvml import FakeNvml

MEMINFO = """MemTotal:        8000000 kB
MemFree:         1000000 kB
MemAvailable:    5000000 kB
Buffers:          500000 kB
Cached:          2000000 kB
SReclaimable:     500000 kB
"""


def fake_proc(tmp_path: Path, busy: int, idle: int) -> Path:
    proc = tmp_path / "proc"
    proc.mkdir(exist_ok=True)
    (proc / "meminfo").write_text(MEMINFO)
    (proc / "stat").write_text(f"cpu  {busy} 0 0 {idle} 0 0 0 0 0 0\ncpu0 1 2 3 4\n")
    return proc


def test_memory_and_cpu_as_psutil_defines_them(tmp_path: Path) -> None:
    gauges = SystemGauges(fake_proc(tmp_path, busy=100, idle=300), disk=str(tmp_path))
    first = gauges.readings()
    assert first["CPUUtilization"] == (25.0, "percent")  # since boot
    # used: what is not available, 8,000,000 - 5,000,000 kB
    assert first["MemoryUsed"] == (3_000_000 * 1024 / 1024**2, "MB")
    assert first["MemoryAvailable"] == (5_000_000 * 1024 / 1024**2, "MB")
    assert first["MemoryUtilization"] == (37.5, "percent")  # (total - available) / total
    fake_proc(tmp_path, busy=190, idle=310)  # 90 busy of the next 100 ticks
    assert gauges.readings()["CPUUtilization"] == (90.0, "percent")


def test_the_text_has_torchserves_names_units_labels_and_filter(tmp_path: Path) -> None:
    gauges = SystemGauges(fake_proc(tmp_path, busy=1, idle=1), disk=str(tmp_path))
    text = "\n".join(gauges.lines('host "a"'))
    assert "# HELP MemoryUsed Torchserve prometheus gauge metric with unit: Megabytes" in text
    assert "# TYPE DiskUsage gauge" in text
    assert "# HELP DiskAvailable Torchserve prometheus gauge metric with unit: Gigabytes" in text
    assert "# HELP CPUUtilization Torchserve prometheus gauge metric with unit: Percent" in text
    assert 'MemoryUtilization{Level="Host",Hostname="host \\"a\\"",} 37.5' in text
    only = gauges.lines("h", frozenset({"DiskUtilization"}))
    assert [line.split()[2] for line in only if line.startswith("#")] == ["DiskUtilization"] * 2


def test_a_host_without_proc_leaves_those_gauges_out(tmp_path: Path) -> None:
    nothing = tmp_path / "nothing"
    gauges = SystemGauges(nothing, disk=str(nothing), gpus=GpuUsage(module="no_such_nvml"))
    assert gauges.readings() == {}
    assert gauges.lines("h") == []


def test_gpu_gauges_per_device(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "fake_nvml", FakeNvml())
    gauges = SystemGauges(tmp_path, disk=str(tmp_path), gpus=GpuUsage(module="fake_nvml"))
    text = "\n".join(gauges.lines("h"))
    assert 'GPUUtilization{Level="Host",device_id="0",Hostname="h",} 42.0' in text
    assert 'GPUMemoryUsed{Level="Host",device_id="0",Hostname="h",} 1024.0' in text
    assert 'GPUMemoryUtilization{Level="Host",device_id="0",Hostname="h",} 1.2' in text
    assert "# HELP GPUMemoryUsed Torchserve prometheus gauge metric with unit: Megabytes" in text


def test_this_hosts_readings_agree_with_psutil() -> None:
    found = SystemGauges().readings()
    disk = psutil.disk_usage("/")
    assert found["DiskUsage"][0] == pytest.approx(disk.used / 1024**3, rel=0.01)
    assert found["DiskAvailable"][0] == pytest.approx(disk.free / 1024**3, rel=0.01)
    assert found["DiskUtilization"][0] == pytest.approx(disk.percent, abs=0.5)
    memory = psutil.virtual_memory()
    assert found["MemoryAvailable"][0] == pytest.approx(memory.available / 1024**2, rel=0.05)
    assert found["MemoryUsed"][0] == pytest.approx(memory.used / 1024**2, rel=0.05)
    assert found["MemoryUtilization"][0] == pytest.approx(memory.percent, abs=3)
