"""The parts of on-demand loading that need no stack: which residents make room, what a
process holds, the fork server, a GPU budget without NVML."""

from __future__ import annotations

import os
import sys
from collections import deque
from pathlib import Path
from typing import Any, cast

import pytest

from sluice.core.exits import EXIT_LOAD_FAILED
from sluice.core.memory_budget import HOST
from sluice.core.placement import threads_per_instance
from sluice.core.repository import RepositoryModel
from sluice.scheduler.executor import on_demand
from sluice.scheduler.executor.fork_server import ForkServer
from sluice.scheduler.executor.on_demand import (
    MAX_LOAD_EXITS,
    PATIENCE_S,
    OnDemand,
    Resident,
    _Look,
    _Room,
)
from sluice.scheduler.executor.process_memory import GpuMemory, NvmlMissing, host_bytes
from sluice.scheduler.executor.supervisor import Child, ChildSpec
from tests.support import procs

MIB = 1 << 20
NOW = 1000.0
LOAD_TIMEOUT_S = 60.0


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
        instance_spec=lambda m, v, threads: ChildSpec(
            "worker", ["w", "--threads", str(threads)], {}, version=v
        ),
        load_timeout_s=LOAD_TIMEOUT_S,
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
    assert demand._victims({HOST: 150 * MIB}, NOW) == [older, old]
    assert demand._victims({HOST: 50 * MIB}, NOW) == [older]


def test_the_least_used_go_before_the_least_recently_used() -> None:
    """A model asked for often but idle a while stays; the one asked for once goes."""
    hot, tail = resident("hot", 400, 100 * MIB), resident("tail", 900, 100 * MIB)
    demand = manager(hot, tail)
    demand._answered = {hot.key: deque([(NOW - 50, 0), (NOW, 12)]), tail.key: deque([(NOW, 1)])}
    assert demand._victims({HOST: 50 * MIB}, NOW) == [tail]
    # ... and the hot one is no candidate at all for a version used less than it
    assert demand._victims({HOST: 150 * MIB}, NOW, demand=3) == []


def test_a_waiting_version_spares_the_more_used_for_a_bounded_time() -> None:
    """A model asked for once waits for a hot one only ``PATIENCE_S``: with a budget that
    holds one model, it is not starved behind one asked for a hundred times a minute."""
    hot = resident("hot", 900, 900 * MIB)
    demand = manager(hot)
    demand._answered = {hot.key: deque([(NOW - 50, 0), (NOW, 100)])}
    demand._queued = {("new", 1): 1}
    need = {HOST: 200 * MIB}
    assert demand._victims(need, NOW, demand._demand(("new", 1), 0.0)) == []
    assert demand._victims(need, NOW, demand._demand(("new", 1), PATIENCE_S - 0.1)) == []
    assert demand._victims(need, NOW, demand._demand(("new", 1), PATIENCE_S)) == [hot]


def test_what_leaving_workers_free_goes_to_the_version_it_was_made_for() -> None:
    room = _Room(now={HOST: 10 * MIB}, later={HOST: 10 * MIB})
    need = {HOST: 30 * MIB}
    assert not room.fits_later(need) and room.short_later(need) == {HOST: 20 * MIB}
    room.leaving({HOST: 40 * MIB})  # evicted for it: exiting, not gone yet
    assert room.fits_later(need) and not room.fits_now(need)
    room.wait_for(need)
    # one placed after it fits in what is free now without taking the first one's share
    assert room.fits_now({HOST: 5 * MIB})
    room.take({HOST: 5 * MIB})
    assert room.later == {HOST: 15 * MIB} and room.now == {HOST: 5 * MIB}
    # ... but not in the first one's share
    assert not room.fits_now({HOST: 20 * MIB}) and not room.fits_later({HOST: 20 * MIB})


def test_room_is_kept_ahead_of_demand_only_while_cold_starts_had_to_evict() -> None:
    """The model asked for once goes ahead of the next cold start; the hot one stays; and
    without recent loads that had to evict, nothing goes."""
    hot, tail = resident("hot", 400, 100 * MIB), resident("tail", 900, 100 * MIB)
    evicted: list[str] = []
    demand = manager(hot, tail)
    cast(Any, demand)._evict = lambda r, reason, ahead=False: evicted.append(r.model.name)
    demand._answered = {hot.key: deque([(NOW - 50, 0), (NOW, 12)]), tail.key: deque([(NOW, 1)])}
    full = _Room(now={HOST: 50 * MIB}, later={HOST: 50 * MIB})
    demand._keep_spare(full, NOW)
    assert evicted == []  # no pressure yet
    demand._pressure = (NOW - 5, 2)
    demand._keep_spare(full, NOW)
    assert evicted == ["tail"] and full.later == {HOST: 150 * MIB}
    demand._keep_spare(full, NOW)  # room enough for the largest resident now
    assert evicted == ["tail"]
    demand._pressure = (NOW - 500, 2)  # long ago
    demand._keep_spare(_Room(now={HOST: 0}, later={HOST: 0}), NOW)
    assert evicted == ["tail"]


def test_queued_loading_and_young_residents_are_never_evicted() -> None:
    busy = resident("busy", 100, 300 * MIB)
    loading = resident("loading", 100, 300 * MIB)
    loading.ready_at = None
    young = resident("young", 100, 300 * MIB, ready_at=NOW - 5)
    demand = manager(busy, loading, young)
    demand._queued = {busy.key: 3}
    assert demand._victims({HOST: 10 * MIB}, NOW) == []  # it waits instead


def test_nothing_is_evicted_when_even_all_would_not_make_room() -> None:
    demand = manager(resident("a", 1, 100 * MIB), resident("b", 2, 100 * MIB))
    assert demand._victims({HOST: 500 * MIB}, NOW) == []


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
        assert procs.wait_until(lambda: server.ready, 60), "it never said it was ready"
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


class _Supervisor:
    """Records the workers retired."""

    def __init__(self) -> None:
        self.retired: list[Child] = []

    def retire(self, children: list[Child]) -> None:
        for child in children:
            child.retiring = True
        self.retired += children


def scaled(workers: int, size: int, wanted: int) -> tuple[OnDemand, Resident, list[ChildSpec]]:
    """A manager with one loaded version of ``workers`` workers holding ``size`` bytes in
    all, which the autoscaler wants at ``wanted``; its ``_start`` records the specs."""
    spec = ChildSpec("worker", ["w"], {}, version=1)
    loaded = resident("hot", NOW, size, ready_at=NOW - 100)
    loaded.children = [Child(spec) for _ in range(workers)]
    loaded.configured = 1
    demand = manager(loaded)
    demand.supervisor = cast(Any, _Supervisor())
    started: list[ChildSpec] = []

    def start(specs: list[ChildSpec]) -> list[Child]:
        started.extend(specs)
        return [Child(s) for s in specs]

    demand._start = start  # type: ignore[method-assign]
    demand._desired = {"hot:1": wanted}
    return demand, loaded, started


def test_an_autoscaled_version_gets_the_workers_that_fit_the_room_free_now() -> None:
    demand, loaded, started = scaled(1, 100 * MIB, wanted=3)
    room = _Room(now={HOST: 900 * MIB}, later={HOST: 900 * MIB})
    demand._scale(room, NOW)
    assert len(started) == 2 and len(loaded.children) == 3
    assert started[0].argv == ["w", "--threads", str(threads_per_instance(3))]
    assert loaded.footprint == {HOST: 300 * MIB} and room.now == {HOST: 700 * MIB}
    # What it shares for its next load, and weighs against the budget, is one instance's.
    assert demand._configured(loaded) == {HOST: 100 * MIB}

    demand, loaded, started = scaled(1, 100 * MIB, wanted=3)
    demand._scale(_Room(now={HOST: 150 * MIB}, later={HOST: 150 * MIB}), NOW)
    assert len(started) == 1  # the budget holds one more now

    # While cold starts have had to evict, the room for the next one stays free.
    demand, loaded, started = scaled(1, 100 * MIB, wanted=3)
    demand._pressure = (NOW - 5, 1)
    demand._scale(_Room(now={HOST: 250 * MIB}, later={HOST: 250 * MIB}), NOW)
    assert len(started) == 1

    # A version waiting for room here goes first: no scaling up meanwhile.
    demand, loaded, started = scaled(1, 100 * MIB, wanted=3)
    demand._wanted_since = {("cold", 1): NOW}
    demand._scale(_Room(now={HOST: 900 * MIB}, later={HOST: 900 * MIB}), NOW)
    assert started == []


def test_an_autoscaled_version_scales_down_to_one_and_frees_what_it_held() -> None:
    demand, loaded, started = scaled(3, 300 * MIB, wanted=1)
    demand._scale(_Room(now={HOST: 0}, later={HOST: 0}), NOW)
    supervisor = cast(_Supervisor, demand.supervisor)
    assert len(supervisor.retired) == 2 and len(loaded.children) == 1
    assert loaded.footprint == {HOST: 100 * MIB} and started == []
    # Zero wanted (a minimum of zero): one stays; unloading it is eviction's business.
    demand, loaded, _ = scaled(2, 200 * MIB, wanted=0)
    demand._scale(_Room(now={HOST: 0}, later={HOST: 0}), NOW)
    assert len(loaded.children) == 1


def loading(*exit_codes: int) -> tuple[OnDemand, Resident, list[str]]:
    """A manager with one version loading, whose worker exited with ``exit_codes`` so far;
    the reasons it refuses versions with are recorded."""
    spec = ChildSpec("worker", ["w"], {}, frozenset({EXIT_LOAD_FAILED}), version=1)
    version = resident("crashy", NOW, 100 * MIB)
    version.ready_at, version.started = None, NOW
    version.children = [Child(spec, exit_codes=list(exit_codes))]
    demand = manager(version)
    refused: list[str] = []
    patched = cast(Any, demand)  # (these ask Redis)
    patched._load_error = lambda r: None
    patched._drop = lambda r, reason, grace_s=None: refused.append(reason)
    return demand, version, refused


def test_a_version_whose_worker_keeps_dying_while_it_loads_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Killed once, the worker is started again and the requests wait for it; crashing at
    every start (in the model's loading, or killed for its memory), the version's requests
    are answered with the reason instead of waiting out their timeouts."""
    monkeypatch.setattr(on_demand, "announced", lambda *args: False)  # (not ready yet)
    demand, version, refused = loading(-9)
    demand._follow(version, _Look(queued=5), NOW)
    assert refused == []
    demand, version, refused = loading(*[-9] * MAX_LOAD_EXITS)
    demand._follow(version, _Look(queued=5), NOW)
    assert refused == [f"its worker exited {MAX_LOAD_EXITS} times while loading it"]
    # The model's own load failures count against --model-load-retry-count, not this.
    demand, version, refused = loading(*[EXIT_LOAD_FAILED] * MAX_LOAD_EXITS)
    demand._follow(version, _Look(queued=5), NOW)
    assert refused == []


def test_a_version_not_ready_by_its_load_deadline_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A load that hangs (a worker that never becomes ready) is abandoned at
    ``SLUICE_ON_DEMAND_LOAD_TIMEOUT_S``: its requests are answered with the reason instead
    of waiting out their timeouts, and the budget it held is given back."""
    ready = [False]
    monkeypatch.setattr(on_demand, "announced", lambda *args: ready[0])
    demand, version, refused = loading()
    demand._follow(version, _Look(queued=1), NOW + LOAD_TIMEOUT_S - 0.1)
    assert refused == []
    demand._follow(version, _Look(queued=1), NOW + LOAD_TIMEOUT_S)
    assert refused == [
        f"its workers were not ready within {LOAD_TIMEOUT_S:g} s of their start "
        "(SLUICE_ON_DEMAND_LOAD_TIMEOUT_S); the load was abandoned"
    ]
    # Ready at the deadline's tick: loaded, not refused.
    demand, version, refused = loading()
    cast(Any, demand)._cold_start = lambda r: None  # (it writes the statistics)
    ready[0] = True
    demand._follow(version, _Look(queued=1), NOW + LOAD_TIMEOUT_S)
    assert refused == [] and version.ready_at == NOW + LOAD_TIMEOUT_S
