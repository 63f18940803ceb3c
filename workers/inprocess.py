"""Running a worker in the caller's own event loop, without ``sluice up``.

For tests and embedding: given a Redis and a model repository, one instance of one model
version serves until the block ends::

    settings = WorkerSettings(redis_url=redis_url, namespace="t1")
    async with running_worker(settings, repository, "identity") as worker:
        ...  # requests to the model's streams are answered (see sluice.core.dispatch)

Leaving the block stops the worker as SIGTERM would: it answers and acknowledges what it
holds, then leaves; its exit status is then ``worker.exit_status``. Its compute runs on the
worker's own thread, as in a worker process.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from sluice.core.errors import InvalidConfig
from sluice.core.placement import Placement
from sluice.core.repository import available_versions, read_model
from sluice.core.settings import WorkerSettings
from sluice.workers.worker import Worker

if TYPE_CHECKING:
    from sluice.core.observability.otel import Tracing


def worker_for(
    settings: WorkerSettings,
    repository: Path,
    model: str,
    version: int | None = None,
    placement: Placement | None = None,
    *,
    slot: int = 0,
    tracing: Tracing | None = None,
    drain: bool = False,
) -> Worker:
    """A worker of ``model`` in ``repository`` (its newest version unless ``version``);
    :class:`InvalidConfig` if the model or the version is not there."""
    # Absolute from here on: a backend may change the working directory (TorchServe's runs
    # the handler in the model's folder).
    repository = repository.resolve()
    entry = read_model(
        repository / model,
        settings.model_config_name,
        default_max_batch_size=settings.default_max_batch_size,
    )
    if entry.config is None or entry.error:
        raise InvalidConfig(f"model '{model}' is unavailable: {entry.error}")
    if version is None:
        version = entry.versions[-1]
    elif version not in available_versions(entry.path):
        # Any version in the repository: what is served is the controller's decision (a
        # rollout serves a version the version policy would not pick yet).
        raise InvalidConfig(f"model '{model}' has no version {version} in the repository")
    return Worker(
        settings,
        entry.config,
        version,
        entry.model_file(version),
        placement or Placement(),
        tracing=tracing,
        slot=slot,
        drain=drain,
    )


@dataclass
class RunningWorker:
    worker: Worker
    task: asyncio.Task[int]
    exit_status: int | None = field(default=None)
    """Set once the worker has left (0: stopped as asked)."""


@asynccontextmanager
async def running_worker(
    settings: WorkerSettings,
    repository: Path,
    model: str,
    version: int | None = None,
    placement: Placement | None = None,
    *,
    slot: int = 0,
) -> AsyncIterator[RunningWorker]:
    """One worker of ``model`` serving in this event loop for the duration of the block."""
    worker = worker_for(settings, repository, model, version, placement, slot=slot)
    running = RunningWorker(worker, asyncio.create_task(worker.run(), name=f"worker-{model}"))
    try:
        yield running
    finally:
        worker.stop()
        running.exit_status = await running.task
