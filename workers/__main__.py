"""``python -m sluice.workers``: run one instance of one model version (see ``sluice worker``)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import sys
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TextIO

from sluice.core.errors import InvalidConfig
from sluice.core.exits import EXIT_LOAD_FAILED
from sluice.core.observability.logs import configure_logging
from sluice.core.observability.tracing import tracing_from_settings
from sluice.core.placement import Placement
from sluice.core.runtime import die_with_parent, exit_after_parent, tune_garbage_collector
from sluice.core.settings import WorkerSettings, settings_at_start
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
        return _run(main())
    finally:
        if tracing is not None:
            tracing.shutdown()  # exports the spans still buffered


def _run(coroutine: Coroutine[Any, Any, int]) -> int:
    """``coroutine`` on uvloop, as the gateway runs (its loop and transports cost less CPU
    per read and write than asyncio's own); on asyncio's loop where uvloop is missing (it
    comes with uvicorn's standard extra, which skips it on Windows)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coroutine)
    return uvloop.run(coroutine)


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
    settings = settings_at_start(WorkerSettings)
    configure_logging("worker", settings)
    exit_after_parent(settings.worker_stop_grace_s)
    threads = settings.threads or args.threads  # 0: every usable core
    placement = Placement(kind=args.kind, gpu=args.gpu, threads=threads)
    return run_worker(
        settings, args.model_repository, args.model, args.version, placement, args.slot
    )


FORK_SERVER_FLAG = "--fork-server"
"""``python -m sluice.workers --fork-server``: forks workers for on-demand loads."""


def fork_server() -> int:
    """Import what a worker needs once, then fork a worker for each order on stdin.

    It says ``ready`` once its imports are done. An order is one JSON line, ``{"argv":
    [...], "env": {...}}`` (this module's arguments and the worker's environment); each
    order gets one answer on stdout, in order: ``started <pid>``, or ``failed <why>`` when
    it cannot fork (out of processes or memory; the other workers go on), and ``exited
    <pid> <status>`` once that worker has ended (the executor cannot wait for a grandchild
    itself). A forked worker skips the second or so the imports take, and shares their
    memory with its siblings until it writes to it. Nothing here has started a thread or an
    event loop when it forks. An end of input (the executor stopped) stops the workers and
    this process."""
    import selectors
    import signal

    import numpy  # noqa: F401  (imported to have it loaded before the forks)

    import sluice.workers.backends.onnxruntime_backend  # noqa: F401

    with contextlib.suppress(ImportError):
        import onnxruntime  # noqa: F401
    with contextlib.suppress(ImportError):
        import uvloop  # noqa: F401  (the workers' event loop: see _run)
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    orders = selectors.DefaultSelector()
    orders.register(sys.stdin.buffer, selectors.EVENT_READ)
    orders.register(wake_read, selectors.EVENT_READ)
    out = sys.stdout
    children: set[int] = set()
    out.write("ready\n")
    out.flush()
    while True:
        for key, _ in orders.select():
            if key.fileobj == wake_read:
                with contextlib.suppress(BlockingIOError):
                    os.read(wake_read, 512)
                continue
            line = sys.stdin.buffer.readline()
            if not line:
                _stop_children(children, out)
                return 0
            try:
                order = json.loads(line)
                pid = os.fork()
            except (OSError, ValueError) as exc:
                out.write(f"failed {' '.join(str(exc).split())}\n")
                out.flush()
                continue
            if pid == 0:
                _become_worker(order, (wake_read, wake_write))
            children.add(pid)
            out.write(f"started {pid}\n")
            out.flush()
        _reap(children, out)


def _reap(children: set[int], out: TextIO) -> None:
    """Report the workers that have ended (``exited <pid> <status>``)."""
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            break
        children.discard(pid)
        out.write(f"exited {pid} {os.waitstatus_to_exitcode(status)}\n")
        out.flush()


def _stop_children(children: set[int], out: TextIO, timeout_s: float = 10.0) -> None:
    """SIGTERM every worker, and reap and report them as they end (within ``timeout_s``):
    orphaned, they would wait for an init that may never reap them."""
    import signal
    import time

    for pid in children:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while children and time.monotonic() < deadline:
        _reap(children, out)
        time.sleep(0.02)


def _become_worker(order: dict[str, object], pipes: tuple[int, int]) -> None:
    """In the forked child: the worker of ``order``; never returns."""
    import signal
    import traceback

    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in pipes:
            os.close(fd)
        os.setsid()
        die_with_parent()
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(2, 1)  # (its output goes where every worker's goes: the log)
        env = order["env"]
        argv = order["argv"]
        assert isinstance(env, dict) and isinstance(argv, list)
        os.environ.clear()
        os.environ.update({str(k): str(v) for k, v in env.items()})
        code = main([str(a) for a in argv])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    sys.exit(fork_server() if sys.argv[1:] == [FORK_SERVER_FLAG] else main())
