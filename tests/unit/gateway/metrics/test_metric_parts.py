"""The pieces of ``/metrics`` that need no server: histogram buckets, the drain estimate,
and the NVML gauges (against a stand-in ``pynvml`` module)."""

from __future__ import annotations

import sys

import pytest

from sluice.core.observability import histograms as hist
from sluice.gateway.metrics.gpu import GPU_FAMILIES, GpuUsage
from sluice.gateway.metrics.sluice_families import DrainRate
from tests.support.fake_nvml import FakeNvml


def test_an_observation_on_a_bound_falls_in_that_bucket() -> None:
    counters: dict[str, int] = {}
    hist.REQUEST.observe(counters, 1_000_000)  # exactly 1 ms: le="0.001"
    hist.REQUEST.observe(counters, 1_000_001)  # just over: le="0.0025"
    hist.REQUEST.observe(counters, 120 * 10**9, times=2)  # past the last bound: +Inf only
    buckets, total = hist.REQUEST.read(counters)
    as_dict = dict(buckets)
    assert as_dict["0.0005"] == 0
    assert as_dict["0.001"] == 1
    assert as_dict["0.0025"] == 2
    assert as_dict["60.0"] == 2
    assert as_dict["+Inf"] == 4
    assert buckets[-1][0] == "+Inf"
    assert total == pytest.approx(0.002000001 + 240)


def test_batch_sizes_use_item_buckets() -> None:
    counters: dict[str, int] = {}
    for size in (1, 3, 8, 2000):
        hist.BATCH_SIZE.observe(counters, size)
    buckets = dict(hist.BATCH_SIZE.read(counters)[0])
    assert (buckets["1.0"], buckets["4.0"], buckets["8.0"], buckets["+Inf"]) == (1, 2, 3, 4)


def test_drain_time_needs_a_second_of_history_then_uses_the_answer_rate() -> None:
    drain = DrainRate(window_s=60)
    key = ("m", 1)
    assert drain.rate(key, 100, now=0.0) is None
    assert drain.rate(key, 150, now=0.5) is None
    assert drain.rate(key, 300, now=2.0) == pytest.approx(100.0)
    assert drain.rate(key, 300, now=62.5) is not None  # old samples age out, one stays


def test_gpu_gauges_in_tritons_names(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeNvml()
    monkeypatch.setitem(sys.modules, "fake_nvml", fake)
    usage = GpuUsage(module="fake_nvml")
    first = "\n".join(usage.lines())
    fake.energy_mj += 2_000_000
    second = usage.lines()
    for name in GPU_FAMILIES:
        assert f"# TYPE {name} " in first
    assert 'nv_gpu_utilization{gpu_uuid="GPU-1234"} 0.42' in second
    assert 'nv_gpu_power_usage{gpu_uuid="GPU-1234"} 150.0' in second
    assert 'nv_gpu_power_limit{gpu_uuid="GPU-1234"} 700.0' in second
    assert f'nv_gpu_memory_total_bytes{{gpu_uuid="GPU-1234"}} {80 << 30}' in second
    # Joules since Sluice started, as Triton's counter: 2,000 J after the first scrape.
    assert 'nv_energy_consumption{gpu_uuid="GPU-1234"} 2000.0' in second


def test_no_gpu_metrics_without_nvml() -> None:
    assert GpuUsage(module="no_such_nvml_module").lines() == []
