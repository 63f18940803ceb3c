"""``python -m sluice.workers``: run one instance of one model version (see ``sluice worker``)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from pathlib import Path

from sluice.core.errors import InvalidConfig
from sluice.core.exits import EXIT_LOAD_FAILED
from sluice.core.logs import configure_logging
from sluice.core.placement import Placement
from sluice.core.runtime import tune_garbage_collector
from sluice.core.settings import WorkerSettings
from sluice.core.tracing import tracing_from_settings
from sluice.workers.inprocess import worker_for
from sluice.workers.lifecycle import install_signal_handlers

log = logging.getLogger("workers")


def run_worker(
    settings: WorkerSettings,
    repository: Path,
    model: str,
    version: int | None,
    placement: Placement,
    slot: int = 0,
) -> int:
    tracing = tracing_from_settings(settings, "worker")
    try:
        worker = worker_for(
            settings, repository, model, version, placement, slot=slot, tracing=tracing
        )
    except InvalidConfig as exc:
        log.error("%s", exc.message)
        if tracing is not None:
            tracing.shutdown()
        return EXIT_LOAD_FAILED
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
    parser = argparse.ArgumentParser(prog="python -m sluice.workers")
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
