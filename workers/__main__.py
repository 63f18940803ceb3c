"""``python -m workers``: run one instance of one model version (see ``sluice worker``)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from pathlib import Path

from sluice.core.exits import EXIT_LOAD_FAILED
from sluice.core.logs import configure_logging
from sluice.core.repository import available_versions, read_model
from sluice.core.runtime import tune_garbage_collector
from sluice.core.settings import WorkerSettings
from sluice.core.tracing import tracing_from_settings
from sluice.workers.backends.base import Placement
from sluice.workers.worker import Worker, install_signal_handlers

log = logging.getLogger("workers")


def run_worker(
    settings: WorkerSettings,
    repository: Path,
    model: str,
    version: int | None,
    placement: Placement,
    slot: int = 0,
) -> int:
    entry = read_model(repository / model)
    if entry.config is None or entry.error:
        log.error("model '%s' is unavailable: %s", model, entry.error)
        return EXIT_LOAD_FAILED
    if version is None:
        version = entry.versions[-1]
    elif version not in available_versions(entry.path):
        # Any version in the repository: what is served is the controller's decision (a
        # rollout serves a version the version policy would not pick yet).
        log.error("model '%s' has no version %d in the repository", model, version)
        return EXIT_LOAD_FAILED
    tracing = tracing_from_settings(settings, "worker")
    worker = Worker(
        settings,
        entry.config,
        version,
        entry.model_file(version),
        placement,
        tracing=tracing,
        slot=slot,
    )
    tune_garbage_collector()

    async def main() -> int:
        install_signal_handlers(worker)
        return await worker.run()

    try:
        return asyncio.run(main())
    finally:
        if tracing is not None:
            tracing.shutdown()  # exports the spans still buffered


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workers")
    parser.add_argument("--model-repository", type=Path, required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--version", type=int)
    parser.add_argument("--kind", default="KIND_CPU", choices=["KIND_CPU", "KIND_GPU"])
    parser.add_argument("--gpu", type=int)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument(
        "--slot", type=int, default=0, help="which instance of the model this worker is (0 ..)"
    )
    args = parser.parse_args(argv)
    settings = WorkerSettings()
    configure_logging("worker", settings)
    threads = settings.threads or args.threads  # 0: every usable core
    placement = Placement(kind=args.kind, gpu=args.gpu, threads=threads)
    return run_worker(
        settings, args.model_repository, args.model, args.version, placement, args.slot
    )


if __name__ == "__main__":
    sys.exit(main())
