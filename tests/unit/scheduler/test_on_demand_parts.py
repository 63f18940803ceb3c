"""The parts of on-demand loading that need no stack: which residents make room, what a
process holds, the fork server, a GPU budget without NVML."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, cast

import pytest

from sluice.core.memory_budget import HOST
from sluice.core.repository import RepositoryModel
from sluice.scheduler.executor.fork_server import ForkServer
from sluice.scheduler.executor.on_demand import OnDemand, Resident
from sluice.scheduler.executor.process_memory import GpuMemory, NvmlMissing, host_bytes
from sluice.scheduler.executor.supervisor import ChildSpec

MIB = 1 << 20
NOW = 1000.0


def resident(name: str, last_used: float, size: int, ready_at: float = 0.0) -> Resident:
    model = RepositoryModel(name, Path(name), None, (1,))
    return Resident(
        model, 1, [], 0.0, None, ready_at=ready_at, last_used=last_used, footprint={HOST: size}
    )


def manager(*residents: Resident, min_residency_s: float = 10.0) -> OnDemand:
    demand = OnDemand(
        cast(Any, None),
        cast(Any, None),
        cast(Any, None),
        "h",
        {},
        lambda m, v: [],
        {HOST: 1000 * MIB},
        min_residency_s,
    )
    demand.residents = {r.key: r for r in residents}
    return demand


def test_the_least_recently_used_go_first_and_no_more_than_needed() -> None:
    old, older, recent = (
        resident("old", 500, 100 * MIB),
        resident("older", 400, 100 * MIB),
        resident("recent", 900, 100 * MIB),
    )
    demand = manager(old, older, recent)
    assert demand._victims({HOST: 150 * MIB}, {}, NOW) == [older, old]
    assert demand._victims({HOST: 50 * MIB}, {}, NOW) == [older]


def test_what_is_leaving_already_counts_as_freed() -> None:
    demand = manager(resident("old", 500, 100 * MIB))
    assert demand._victims({HOST: 80 * MIB}, {HOST: 80 * MIB}, NOW) == []


def test_queued_loading_and_young_residents_are_never_evicted() -> None:
    busy = resident("busy", 100, 300 * MIB)
    loading = resident("loading", 100, 300 * MIB)
    loading.ready_at = None
    young = resident("young", 100, 300 * MIB, ready_at=NOW - 5)
    demand = manager(busy, loading, young)
    demand._queued = {busy.key: 3}
    assert demand._victims({HOST: 10 * MIB}, {}, NOW) == []  # it waits instead


def test_nothing_is_evicted_when_even_all_would_not_make_room() -> None:
    demand = manager(resident("a", 1, 100 * MIB), resident("b", 2, 100 * MIB))
    assert demand._victims({HOST: 500 * MIB}, {}, NOW) == []


def test_a_process_holds_memory_and_a_gone_one_none() -> None:
    assert host_bytes(os.getpid()) > 10 * MIB
    assert host_bytes(2**22 + 12345) == 0


def test_a_gpu_budget_without_nvml_says_what_it_needs() -> None:
    with pytest.raises(NvmlMissing, match=r"SLUICE_GPU_MEMORY_BUDGET needs NVML .*nvidia-ml-py"):
        GpuMemory(module="no_such_nvml_module").start([0])


def test_the_fork_server_forks_the_worker_it_is_told_to_be() -> None:
    """Its order arrives: the worker's own argument parsing answers (status 2, the usage),
    and the server reports the exit of its child."""
    exits: list[int] = []
    server = ForkServer(dict(os.environ), lambda: exits.append(1))
    server.ensure()
    try:
        spec = ChildSpec("worker x", [sys.executable, "-m", "sluice.workers", "--no-such-flag"], {})
        process = server.spawn(spec)
        assert process is not None and process.poll() in (None, 2)
        assert process.wait(60) == 2
        assert exits
        again = server.spawn(spec)
        assert again is not None and again.pid != process.pid and again.wait(60) == 2
    finally:
        server.stop()


def test_the_fork_server_forks_workers_only() -> None:
    server = ForkServer(dict(os.environ))
    server.ensure()
    try:
        gateway = ChildSpec("gateway", [sys.executable, "-m", "sluice.gateway"], {})
        assert server.spawn(gateway) is None
    finally:
        server.stop()
    assert server.spawn(ChildSpec("w", [sys.executable, "-m", "sluice.workers"], {})) is None
