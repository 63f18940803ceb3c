"""``python -m bench``: load a Sluice stack over loopback and compare it with in-process ORT.

Examples::

    python -m bench --model mlp --concurrency 1,4,16,64,128 --duration 5 --mode binary
    python -m bench --model cnn --rate 100,200,300 --mode binary,json
    python -m bench --model mlp --url http://127.0.0.1:8000 --stack-pid 12345
    python -m bench --model mlp --loadgen wrk --concurrency 64 --mode binary,json
    python -m bench --model mlp --loadgen h2load --rate 100,1000 --mode binary

Without ``--url`` the bench starts ``sluice up`` itself on a free port, over the whole
repository (idle models included, as a user's; ``--only-model`` serves the benchmarked one
alone) with its defaults, and stops it at the end. The in-process baseline is the engine at
its best on this machine: the best of 1 .. every core's intra-op threads (``--threads N``
fixes both sides to N instead).
``--loadgen wrk`` (closed loop, ``--concurrency`` connections) and ``--loadgen h2load``
(``--rate`` requests/s, evenly spaced) load the server with C load generators instead of
the bench's Python clients. Every run reports the stack's idle CPU, measured after the
load for ``--idle-seconds``. Outputs go to ``--out`` (results.json, results.md, throughput.png,
latency.png); the Markdown table is also printed to stdout.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import os
import platform
import shlex
import sys
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import onnxruntime

from bench import c_loadgen, h2load, library_clients, loadgen
from bench.baseline import (
    Baseline,
    config_max_batch_size,
    latest_model_file,
    run_baseline,
    run_best_baseline,
    run_paced,
)
from bench.client import (
    HttpError,
    Target,
    connect,
    get_json,
    model_path,
    parse_target,
    wait_until_ready,
)
from bench.cpu import CpuMeter
from bench.payload import MODES, InferRequest, build_request
from bench.report import Point, Results, summarize, write_all
from bench.stack import Stack, start_stack, stop_stack
from bench.torch_baseline import run_torch_baseline, torchscript_file, wants_gpu

DEFAULT_CONCURRENCY = "1,4,16,64,128"
IDLE_SECONDS = 10.0  # stack CPU is sampled this long with no load, after the load
IDLE_SETTLE_SECONDS = 2.0  # let the last requests' work end before the idle sample
PACED_SECONDS = 5.0  # the in-process engine at each --rate, for its own CPU per run


def _ints(text: str) -> list[int]:
    values = [int(part) for part in text.split(",") if part.strip()]
    if any(value < 1 for value in values):
        raise argparse.ArgumentTypeError("values must be positive")
    return values


def _floats(text: str) -> list[float]:
    values = [float(part) for part in text.split(",") if part.strip()]
    if any(value <= 0 for value in values):
        raise argparse.ArgumentTypeError("values must be positive")
    return values


def _modes(text: str) -> list[str]:
    modes = [part.strip() for part in text.split(",") if part.strip()]
    unknown = sorted(set(modes) - set(MODES))
    if unknown or not modes:
        raise argparse.ArgumentTypeError(f"modes are {', '.join(MODES)}; got {text!r}")
    return modes


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench",
        description="Load a Sluice stack over loopback and compare it with in-process ORT.",
    )
    parser.add_argument("--model", required=True, help="model name in the repository")
    parser.add_argument(
        "--concurrency",
        type=_ints,
        help=f"closed-loop concurrencies (default {DEFAULT_CONCURRENCY} unless --rate is given)",
    )
    parser.add_argument(
        "--rate",
        type=_floats,
        default=[],
        help="open-loop requests/s, e.g. 500,1000 (default: none)",
    )
    parser.add_argument(
        "--duration", type=float, default=5.0, help="measured seconds per point (default 5)"
    )
    parser.add_argument(
        "--warmup", type=float, default=1.0, help="uncounted warm-up seconds per point (default 1)"
    )
    parser.add_argument(
        "--mode",
        type=_modes,
        default=["binary"],
        help="binary, json or binary,json (default binary)",
    )
    parser.add_argument(
        "--batch", type=int, default=1, help="batch entries per request (default 1)"
    )
    parser.add_argument(
        "--max-in-flight", type=int, default=256, help="open-loop in-flight cap (default 256)"
    )
    parser.add_argument(
        "--client",
        choices=library_clients.CLIENTS,
        default="raw",
        help="closed-loop load generator: raw (the bench's pre-encoded requests on raw "
        "keep-alive sockets, the cheapest client), aiohttp (a general-purpose asyncio client "
        "sending the same bytes) or tritonclient (tritonclient.http.aio); default raw",
    )
    parser.add_argument(
        "--loadgen",
        choices=c_loadgen.LOADGENS,
        default="python",
        help="python (the bench's own clients, see --client), wrk (C, closed loop over "
        "--concurrency connections: saturation) or h2load (C, --rate requests/s with evenly "
        "spaced arrivals); default python",
    )
    parser.add_argument("--wrk-threads", type=int, default=1, help="wrk's threads (default 1)")
    parser.add_argument(
        "--h2load-clients",
        type=int,
        default=0,
        help="h2load: at least this many connections (default 0: one per "
        f"{h2load.CLIENT_INTERVAL_S * 1000:g} ms of the rate's interval)",
    )
    parser.add_argument(
        "--idle-seconds",
        type=float,
        default=IDLE_SECONDS,
        help=f"seconds of idle stack CPU sampled after the load (default {IDLE_SECONDS:g}; "
        "0 skips it)",
    )
    parser.add_argument("--url", help="use a running stack (loopback only) instead of starting one")
    parser.add_argument(
        "--stack-pid", type=int, help="with --url: root pid of the stack, for CPU accounting"
    )
    parser.add_argument(
        "--model-repository",
        type=Path,
        default=Path("model_repository"),
        help="repository for the stack and the baseline (default model_repository)",
    )
    parser.add_argument(
        "--http-port", type=int, help="port for the stack the bench starts (default: a free one)"
    )
    parser.add_argument("--stack-args", default="", help="extra arguments for `sluice up`")
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="intra-op threads of the baseline, and of the workers of a stack the bench "
        "starts (as SLUICE_THREADS); default 0: the baseline takes the best of 1..all cores "
        "and the stack runs with its defaults",
    )
    parser.add_argument(
        "--only-model",
        action="store_true",
        help="serve only the benchmarked model (default: the whole repository, idle models "
        "included, as a user's)",
    )
    parser.add_argument(
        "--baseline-seconds",
        type=float,
        default=0.5,
        help="in-process seconds per batch size (default 0.5)",
    )
    parser.add_argument("--no-baseline", action="store_true", help="skip the in-process baseline")
    parser.add_argument(
        "--out", type=Path, default=Path("bench/out"), help="output folder (default bench/out)"
    )
    args = parser.parse_args(argv)
    if args.client != "raw" and args.rate:
        parser.error("--rate needs --client raw (the open loop sends pre-encoded requests)")
    if args.loadgen != "python" and args.client != "raw":
        parser.error(f"--client {args.client} only goes with --loadgen python")
    if args.loadgen == "wrk" and args.rate:
        parser.error("--loadgen wrk runs closed loops (--concurrency); use h2load for --rate")
    if args.loadgen == "h2load" and (args.concurrency or not args.rate):
        parser.error("--loadgen h2load runs fixed rates: give --rate, not --concurrency")
    if args.concurrency is None:
        args.concurrency = [] if args.rate else _ints(DEFAULT_CONCURRENCY)
    if args.url is not None:
        try:
            parse_target(args.url)
        except ValueError as exc:
            parser.error(str(exc))
    elif args.stack_pid is not None:
        parser.error("--stack-pid only makes sense with --url")
    return args


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- setup


def ensure_model_files(repository: Path) -> None:
    """Build the example models if the repository has a build.py and they are missing."""
    script = repository / "build.py"
    if not script.is_file():
        return
    spec = importlib.util.spec_from_file_location("model_repository_build", script)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for path in module.build_all(repository):
        log(f"built {path}")


def max_batch_size(target: Target, model: str, repository: Path) -> int:
    """From ``GET /v2/models/<m>/config``, else from the local config.pbtxt."""
    try:
        return int(get_json(target, model_path(model, "/config"))["max_batch_size"])
    except (HttpError, OSError, KeyError, ValueError) as exc:
        log(f"GET config failed ({exc}); reading {repository / model / 'config.pbtxt'}")
        return config_max_batch_size(repository, model)


def baseline_for(args: argparse.Namespace, max_batch: int) -> Baseline | None:
    if args.no_baseline:
        return None
    script = torchscript_file(args.model_repository, args.model)
    if script is not None:
        gpu = wants_gpu(args.model_repository, args.model)
        log(f"in-process torch baseline: {script} on {'GPU 0' if gpu else 'the CPU'}")
        baseline = run_torch_baseline(
            script, args.model_metadata, max_batch, gpu, args.baseline_seconds
        )
        _log_points(baseline)
        return baseline
    try:
        path = latest_model_file(args.model_repository, args.model)
    except FileNotFoundError as exc:
        log(f"no in-process baseline: {exc}")
        return None
    if args.threads:
        log(f"in-process baseline: {path}, batch 1..{max_batch}, {args.threads} thread(s)")
        baseline = run_baseline(path, max_batch, args.threads, args.baseline_seconds)
    else:
        log(f"in-process baseline: {path}, batch 1..{max_batch}, the best of 1..all cores")
        baseline = run_best_baseline(path, max_batch, args.baseline_seconds)
        log(f"  best with {baseline.threads} thread(s)")
    _log_points(baseline)
    for rate in args.rate:
        # What the engine alone spends per run at the rate the stack is loaded at.
        paced = run_paced(path, max_batch > 0, baseline.threads, rate, PACED_SECONDS)
        baseline.paced.append(paced)
        log(
            f"  {rate:g} batch-1 runs/s, evenly spaced: {paced.cpu_us_per_run:,.0f} us of CPU "
            f"per run, p50 {paced.p50_ms:.3f} ms"
        )
    return baseline


def _log_points(baseline: Baseline) -> None:
    for point in baseline.points:
        log(
            f"  batch {point.batch:4d}: p50 {point.p50_ms:9.3f} ms, "
            f"{point.items_per_s:12,.0f} items/s"
        )


async def _probe(target: Target, raw: bytes) -> tuple[int, bytes]:
    connection = await connect(target)
    try:
        return await connection.request(raw)
    finally:
        connection.close()


def check_request(target: Target, request: InferRequest) -> None:
    """Send the request once; fail early (with the server's answer) if it is not accepted."""
    status, body = loadgen.run(_probe(target, request.raw))
    if status != 200:
        raise RuntimeError(f"{request.mode} request rejected: HTTP {status}: {body[:500]!r}")


# ----------------------------------------------------------------------------- load


def run_c_point(
    args: argparse.Namespace,
    target: Target,
    request: InferRequest,
    load: float,
    meter: CpuMeter,
    baseline: Baseline | None,
) -> Point:
    """One point driven by wrk (closed loop, ``load`` connections) or h2load (``load``/s)."""
    meter.last = None
    if args.loadgen == "wrk":
        point = c_loadgen.wrk_point(
            target,
            request,
            int(load),
            args.duration,
            args.warmup,
            args.wrk_threads,
            meter,
            baseline,
        )
    else:
        point = c_loadgen.h2load_point(
            target,
            request,
            load,
            args.duration,
            args.warmup,
            args.h2load_clients,
            meter,
            baseline,
            log,
        )
    _log_point(point)
    return point


def _log_point(point: Point) -> None:
    cpu = point.cpu_ms_per_request or {}
    log(
        f"{point.loadgen:6s} {point.loop:6s} {point.mode:6s} {point.load:>9s}: "
        f"{point.requests_per_s:9,.0f} req/s, p50 {point.p50_ms or 0:7.2f} ms, "
        f"p99 {point.p99_ms or 0:7.2f} ms, errors {point.errors}"
        + (f", dropped {point.dropped}" if point.dropped else "")
        + (f", stack CPU {cpu['stack'] * 1000:,.0f} us/req" if "stack" in cpu else "")
    )


def run_point(
    args: argparse.Namespace,
    target: Target,
    request: InferRequest,
    loop: str,
    load: float,
    meter: CpuMeter,
    baseline: Baseline | None,
) -> Point:
    meter.last = None
    coroutine: Coroutine[Any, Any, loadgen.LoadResult]
    if loop == "closed" and args.client != "raw":
        coroutine = library_clients.closed_loop(
            args.client,
            target,
            args.model,
            args.model_metadata,
            args.max_batch,
            request,
            args.batch,
            int(load),
            args.duration,
            args.warmup,
            meter.on_window,
        )
    elif loop == "closed":
        coroutine = loadgen.closed_loop(
            target, request.raw, int(load), args.duration, args.warmup, meter.on_window
        )
    else:
        coroutine = loadgen.open_loop(
            target,
            request.raw,
            load,
            args.duration,
            args.warmup,
            args.max_in_flight,
            meter.on_window,
        )
    result = loadgen.run(coroutine)
    point = summarize(loop, request.mode, load, result, request.items, meter.last, baseline)
    _log_point(point)
    return point


def build_requests(
    args: argparse.Namespace, target: Target, metadata: dict[str, Any], max_batch: int
) -> list[InferRequest]:
    """One pre-encoded request per mode, each checked once against the server."""
    requests = []
    for mode in args.mode:
        request = build_request(target, args.model, metadata, max_batch, mode, args.batch)
        check_request(target, request)
        requests.append(request)
    return requests


def run_load(
    args: argparse.Namespace,
    target: Target,
    requests: list[InferRequest],
    meter: CpuMeter,
    baseline: Baseline | None,
) -> list[Point]:
    points: list[Point] = []
    if args.loadgen != "python":
        for request in requests:
            for load in [*args.concurrency, *args.rate]:
                points.append(run_c_point(args, target, request, load, meter, baseline))
        return points
    for request in requests:
        for concurrency in args.concurrency:
            points.append(run_point(args, target, request, "closed", concurrency, meter, baseline))
        for rate in args.rate:
            points.append(run_point(args, target, request, "open", rate, meter, baseline))
    return points


def metadata_of(args: argparse.Namespace, target: Target, stack: Stack | None) -> dict[str, Any]:
    return {
        "model": args.model,
        "modes": args.mode,
        "client": args.client,
        "loadgen": args.loadgen,
        "url": target.url,
        "started_stack": stack is not None,
        "stack_command": shlex.join(stack.process.args) if stack is not None else None,  # type: ignore[arg-type]
        "duration_s": args.duration,
        "warmup_s": args.warmup,
        "batch": args.batch,
        "threads": args.threads,
        "max_in_flight": args.max_in_flight,
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "onnxruntime": onnxruntime.__version__,
        "started_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "argv": sys.argv,
    }


def single_model_repository(repository: Path, model: str, out: Path) -> Path:
    """A repository holding only the benchmarked model (a symlink), so that other models'
    idle workers neither take CPU from the run nor count in its per-request CPU cost."""
    served = out / "repository"
    if served.is_symlink() or served.is_file():
        served.unlink()
    served.mkdir(parents=True, exist_ok=True)
    for entry in served.iterdir():
        entry.unlink()
    (served / model).symlink_to((repository / model).resolve(), target_is_directory=True)
    return served


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.loadgen != "python":
        try:
            c_loadgen.find_tool(args.loadgen)
        except c_loadgen.ToolMissing as exc:
            log(f"error: {exc}")
            return 2
    args.out.mkdir(parents=True, exist_ok=True)
    if args.url is None or not args.no_baseline:
        ensure_model_files(args.model_repository)
    stack: Stack | None = None
    try:
        if args.url is None:
            served = args.model_repository
            if args.only_model:
                served = single_model_repository(args.model_repository, args.model, args.out)
            log(f"starting sluice up --model-repository {served}")
            stack = start_stack(
                served,
                args.http_port,
                args.out / "stack.log",
                shlex.split(args.stack_args),
                # Workers read SLUICE_THREADS: the baseline's thread count when one is given.
                {"SLUICE_THREADS": str(args.threads)} if args.threads else {},
            )
            log(f"stack ready at {stack.url} (pid {stack.pid}; log {args.out / 'stack.log'})")
        # The bench's own stack listens on the port it was given, whatever URL it printed.
        target = Target("127.0.0.1", stack.port) if stack is not None else parse_target(args.url)
        wait_until_ready(target, args.model)
        model_metadata = get_json(target, model_path(args.model))
        max_batch = max_batch_size(target, args.model, args.model_repository)
        requests = build_requests(args, target, model_metadata, max_batch)
        args.model_metadata, args.max_batch = model_metadata, max_batch
        meter = CpuMeter(stack.pid if stack is not None else args.stack_pid)
        meta = metadata_of(args, target, stack)
        meta["max_batch_size"] = max_batch
        meta["request_body_bytes"] = {request.mode: request.body_bytes for request in requests}
        meta["processes"] = meter.group_counts()
        baseline = baseline_for(args, max_batch)
        points = run_load(args, target, requests, meter, baseline)
        if meter.stack_pid is not None and args.idle_seconds > 0:
            time.sleep(IDLE_SETTLE_SECONDS)
            meta["idle_seconds"] = args.idle_seconds
            meta["idle_cpu_percent"] = meter.idle_percent(args.idle_seconds)
            log(f"idle stack CPU (% of a core): {meta['idle_cpu_percent']}")
    finally:
        if stack is not None:
            log(f"stopping the stack (exit status {stop_stack(stack)})")
    results = Results(meta=meta, baseline=baseline, points=points)
    print(write_all(args.out, results))
    log(f"wrote {args.out}/results.json, results.md, throughput.png, latency.png")
    return 1 if any(point.errors for point in points) else 0
