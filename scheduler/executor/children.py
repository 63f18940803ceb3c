"""What ``sluice up`` supervises: one child spec per gateway process, batch worker and model
instance, with the environment each is given."""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
from pathlib import Path

from sluice.core.batch_jobs.celery_config import broker_url
from sluice.core.exits import EXIT_LOAD_FAILED
from sluice.core.placement import placements, threads_per_instance, visible_gpus
from sluice.core.repository import RepositoryModel
from sluice.core.settings import UpSettings, locations_text
from sluice.scheduler.executor.instances import InstanceSpec
from sluice.scheduler.executor.listeners import Listeners
from sluice.scheduler.executor.supervisor import ChildSpec

log = logging.getLogger("sluice.up")


def worker_specs(
    models: list[RepositoryModel],
    repository: Path,
    env: dict[str, str],
    threads: int | None = None,
) -> list[ChildSpec]:
    """One child per instance of each served version of each usable model."""
    usable = [m for m in models if m.config is not None and m.error is None]
    specs: list[ChildSpec] = []
    for model in usable:
        assert model.config is not None
        model_threads = threads or threads_per_instance(model.config.total_instances)
        where = placements(model.config.instance_groups, visible_gpus())
        for version in model.versions:
            for index, placement in enumerate(where):
                argv = [
                    sys.executable,
                    "-m",
                    "sluice.workers",
                    "--model-repository",
                    str(repository),
                    "--model",
                    model.name,
                    "--version",
                    str(version),
                    "--kind",
                    placement.kind,
                    "--threads",
                    str(model_threads),
                    "--slot",
                    str(index),
                ]
                if placement.gpu is not None:
                    argv += ["--gpu", str(placement.gpu)]
                specs.append(
                    ChildSpec(
                        f"worker {model.name}:{version}#{index}",
                        argv,
                        env,
                        frozenset({EXIT_LOAD_FAILED}),
                        version=version,
                    )
                )
    return specs


def instance_spec(env: dict[str, str]) -> InstanceSpec:
    """One more worker of a model version (autoscaling), like those it started with."""

    def spec(model: RepositoryModel, version: int, threads: int) -> ChildSpec:
        specs = worker_specs([model], model.path.parent, env, threads)
        return next(s for s in specs if s.version == version)

    return spec


def batch_data_env(settings: UpSettings) -> dict[str, str]:
    """What the gateways and batch workers learn of batch data: the store (a data directory
    of its own by default, never the directory ``sluice up`` started in) and the model
    repository, where no batch job may read or write."""
    store = settings.batch_store
    if store and not store.startswith("s3://"):
        store = os.path.abspath(store)
    locations = tuple(
        location if location.startswith("s3://") else os.path.abspath(location)
        for location in settings.model_repository
    )
    return {"SLUICE_BATCH_STORE": store, "SLUICE_MODEL_REPOSITORY": locations_text(locations)}


def batch_worker_specs(settings: UpSettings, env: dict[str, str]) -> list[ChildSpec]:
    """The batch workers (Celery), when the batch extra is installed."""
    if not settings.batch_workers:
        return []
    if importlib.util.find_spec("celery") is None:
        log.info("no batch workers: batch jobs need Celery (pip install 'sluice[batch]')")
        return []
    try:
        broker_url(settings.redis_url, settings.batch_broker_url)
    except ValueError as exc:
        log.warning("no batch workers: %s", exc)
        return []
    return [
        ChildSpec(f"batch-worker#{index}", [sys.executable, "-m", "sluice.batch"], env)
        for index in range(settings.batch_workers)
    ]


def gateway_specs(
    settings: UpSettings, env: dict[str, str], listeners: Listeners
) -> list[ChildSpec]:
    gateway_env = dict(
        env,
        SLUICE_HTTP_HOST=settings.http_host,
        SLUICE_HTTP_PORT=str(settings.http_port),
        SLUICE_HTTP_FD=str(listeners.http.fileno()),
        SLUICE_GATEWAY_PROCESSES=str(settings.gateway_processes),
        SLUICE_GRPC_PORT=str(settings.grpc_port),
        SLUICE_GRPC_REUSE_PORT="true",
        SLUICE_SHM_SAME_HOST=str(settings.shm_same_host).lower(),
        SLUICE_TORCHSERVE_PORTS=settings.torchserve_ports,
        SLUICE_TORCHSERVE_FDS=",".join(
            str(listener.fileno() if listener is not None else -1)
            for listener in listeners.torchserve
        ),
    )
    if listeners.metrics is not None:
        gateway_env.update(
            SLUICE_METRICS_PORT=str(settings.metrics_port),
            SLUICE_METRICS_FD=str(listeners.metrics.fileno()),
        )
    else:
        gateway_env.update(SLUICE_METRICS_PORT="0", SLUICE_METRICS_FD="-1")
    return [
        ChildSpec(
            f"gateway#{index}",
            [sys.executable, "-m", "sluice.gateway"],
            gateway_env,
            pass_fds=tuple(listener.fileno() for listener in listeners.all()),
        )
        for index in range(settings.gateway_processes)
    ]
