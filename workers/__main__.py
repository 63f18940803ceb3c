"""``python -m workers``: run one instance of one model version (see ``sluice worker``)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from pathlib import Path

from sluice.repository import read_model
from sluice.runtime import tune_garbage_collector
from sluice.settings import WorkerSettings
from workers.backends.base import Placement
from workers.worker import EXIT_LOAD_FAILED, Worker, install_signal_handlers

log = logging.getLogger("workers")


def run_worker(
    settings: WorkerSettings,
    repository: Path,
    model: str,
    version: int | None,
    placement: Placement,
) -> int:
    entry = read_model(repository / model)
    if entry.config is None or entry.error:
        log.error("model '%s' is unavailable: %s", model, entry.error)
        return EXIT_LOAD_FAILED
    if version is None:
        version = entry.versions[-1]
    elif version not in entry.versions:
        log.error(
            "model '%s' has no served version %d (served: %s)", model, version, entry.versions
        )
        return EXIT_LOAD_FAILED
    worker = Worker(settings, entry.config, version, entry.model_file(version), placement)
    tune_garbage_collector()

    async def main() -> int:
        install_signal_handlers(worker)
        return await worker.run()

    return asyncio.run(main())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workers")
    parser.add_argument("--model-repository", type=Path, required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--version", type=int)
    parser.add_argument("--kind", default="KIND_CPU", choices=["KIND_CPU", "KIND_GPU"])
    parser.add_argument("--gpu", type=int)
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s worker %(name)s %(levelname)s %(message)s"
    )
    settings = WorkerSettings()
    threads = settings.threads or args.threads or 1
    placement = Placement(kind=args.kind, gpu=args.gpu, threads=threads)
    return run_worker(settings, args.model_repository, args.model, args.version, placement)


if __name__ == "__main__":
    sys.exit(main())
