"""How ``sluice up`` sets on-demand models apart and starts their manager (:mod:`.on_demand`)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from dataclasses import replace
from pathlib import Path

from redis import Redis

from sluice.core.errors import InvalidConfig, StartupFailed
from sluice.core.hosts import host_id
from sluice.core.keys import Keys
from sluice.core.memory_budget import HOST, format_size, gpu_device
from sluice.core.on_demand import LOAD_KEY, is_on_demand
from sluice.core.repository import RepositoryModel
from sluice.core.settings import UpSettings
from sluice.scheduler.executor.children import instance_spec, worker_specs
from sluice.scheduler.executor.fork_server import ForkServer
from sluice.scheduler.executor.on_demand import OnDemand
from sluice.scheduler.executor.process_memory import GpuMemory, NvmlMissing
from sluice.scheduler.executor.supervisor import ChildSpec, Supervisor

log = logging.getLogger("sluice.up")


def split_on_demand(
    models: list[RepositoryModel], mode: str
) -> tuple[list[RepositoryModel], frozenset[str]]:
    """The models (one whose ``sluice.load`` is not understood made unavailable, with the
    reason) and the names of those loaded on demand under ``mode``."""
    checked: list[RepositoryModel] = []
    demanded: set[str] = set()
    for model in models:
        if model.config is not None and model.error is None:
            try:
                if is_on_demand(model.config, mode):
                    demanded.add(model.name)
                elif mode in ("explicit", "poll") and LOAD_KEY in model.config.parameters:
                    log.warning(
                        "model '%s': %s is followed with --model-control-mode none or "
                        "demand only, not %s",
                        model.name,
                        LOAD_KEY,
                        mode,
                    )
            except InvalidConfig as exc:
                model = replace(model, error=exc.message)
        checked.append(model)
    return checked, frozenset(demanded)


def with_on_demand(
    catalog: list[RepositoryModel], demanded: Collection[str], models: list[RepositoryModel]
) -> list[RepositoryModel]:
    """The catalog to publish: ``catalog``, with each on-demand model of ``models`` served
    (it takes requests whether or not a worker runs)."""
    by_name = {model.name: model for model in catalog}
    for model in models:
        if model.name in demanded:
            by_name[model.name] = model
    return [by_name[name] for name in sorted(by_name)]


def start_on_demand(
    settings: UpSettings,
    client: Redis,
    keys: Keys,
    supervisor: Supervisor,
    demanded: Collection[str],
    models: list[RepositoryModel],
    repository: Path,
    env: dict[str, str],
    on_exit: Callable[[], None],
) -> OnDemand | None:
    """The manager of the on-demand models (None without any); StartupFailed when a GPU
    budget cannot be measured here. ``on_exit``: wakes the tick loop when a forked worker
    exits (it is not this process's child: no SIGCHLD comes)."""
    if not demanded:
        return None
    gpu = None
    if settings.gpu_memory_budget:
        gpu = GpuMemory()
        try:
            gpu.start(sorted(settings.gpu_memory_budget))
        except NvmlMissing as exc:
            raise StartupFailed(str(exc)) from None
    budget = {HOST: settings.memory_budget}
    budget.update({gpu_device(i): size for i, size in settings.gpu_memory_budget.items()})

    def specs(model: RepositoryModel, version: int) -> list[ChildSpec]:
        return [s for s in worker_specs([model], repository, env) if s.version == version]

    log.info(
        "%d model(s) load on demand within a memory budget of %s",
        len(demanded),
        format_size(settings.memory_budget),
    )
    return OnDemand(
        client,
        keys,
        supervisor,
        host_id(settings.host_id),
        {m.name: m for m in models if m.name in demanded},
        specs,
        budget,
        settings.min_residency_s,
        instance_spec=instance_spec(env),
        load_timeout_s=settings.on_demand_load_timeout_s,
        gpu=gpu,
        forks=ForkServer(env, on_exit) if settings.fork_server else None,
    )
