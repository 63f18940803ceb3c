"""Load points driven by the C load generators (wrk, h2load) instead of the Python clients.

The Python clients stay what users' clients cost; wrk and h2load cost the server less
client CPU on the same cores, so the server's own ceiling and its CPU per request show.
Each point runs the tool once for the warm-up (not counted), then once measured, with the
server's CPU per role read from /proc around the measured run (:class:`bench.cpu.CpuMeter`)
and the tool's own CPU (a child process: its rusage once it has exited) as ``loadgen``.
"""

from __future__ import annotations

import resource
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench import h2load, wrk
from bench.baseline import Baseline
from bench.client import Target
from bench.cpu import CpuMeter
from bench.http_request import split_request
from bench.loadgen import LoadResult
from bench.payload import InferRequest
from bench.report import Point, cpu_per_request, summarize

LOADGENS = ("python", "wrk", "h2load")
DEBIAN_PACKAGES = {"wrk": "wrk", "h2load": "nghttp2-client"}
MIN_WARMUP_S = 0.5  # shorter warm-ups are skipped (wrk counts whole seconds)
RUN_SLACK_S = 30.0  # a tool still running this long after its planned end is killed


class ToolMissing(RuntimeError):
    """A C load generator is not installed."""


def find_tool(name: str) -> str:
    """The path of ``wrk`` or ``h2load``; :class:`ToolMissing` says what to install."""
    path = shutil.which(name)
    if path is None:
        raise ToolMissing(
            f"{name} is not installed: install the Debian package {DEBIAN_PACKAGES[name]} "
            f"(apt-get install {DEBIAN_PACKAGES[name]}; `make bench` does it when run as root)"
        )
    return path


@dataclass(frozen=True)
class ToolRun:
    stdout: str
    cpu_seconds: dict[str, float]  # per role, the tool's own as "loadgen"


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_tool(command: list[str], timeout: float, meter: CpuMeter | None) -> ToolRun:
    """Run a load generator to its end; with ``meter``, the CPU per role meanwhile."""
    if meter is not None:
        meter.start()
    children_before = _children_cpu()
    finished = subprocess.run(
        command, capture_output=True, text=True, errors="replace", timeout=timeout, check=False
    )
    tool_cpu = _children_cpu() - children_before
    cpu_seconds: dict[str, float] = {}
    if meter is not None:
        cpu_seconds = meter.stop()
        cpu_seconds["loadgen"] = cpu_seconds.get("loadgen", 0.0) + tool_cpu
        meter.last = cpu_seconds
    if finished.returncode != 0:
        raise RuntimeError(
            f"{Path(command[0]).name} exited with {finished.returncode}: "
            f"{(finished.stderr or finished.stdout)[-2000:]}"
        )
    return ToolRun(finished.stdout, cpu_seconds)


Log = Callable[[str], None]


def wrk_point(
    target: Target,
    request: InferRequest,
    connections: int,
    duration: float,
    warmup: float,
    threads: int,
    meter: CpuMeter,
    baseline: Baseline | None,
) -> Point:
    """A saturation point: ``connections`` wrk connections back to back for ``duration``."""
    executable = find_tool("wrk")
    with tempfile.TemporaryDirectory(prefix="bench-wrk-") as folder:
        script = wrk.write_script(Path(folder), split_request(request.raw))

        def once(seconds: float, measured: CpuMeter | None) -> ToolRun:
            line = wrk.command(executable, target.url, script, connections, seconds, threads)
            return run_tool(line, seconds + RUN_SLACK_S, measured)

        if warmup >= MIN_WARMUP_S:
            once(warmup, None)
        run = once(duration, meter)
    result = wrk.parse_output(run.stdout)
    samples = []
    if result.non_2xx:
        samples.append(f"{result.non_2xx} non-2xx/3xx responses")
    samples += [
        f"{count} socket {kind} errors" for kind, count in result.socket_errors.items() if count
    ]
    latency = result.latency_ms
    requests_per_s = result.ok / result.duration_s if result.duration_s > 0 else 0.0
    items_per_s = requests_per_s * request.items
    return Point(
        loop="closed",
        mode=request.mode,
        concurrency=connections,
        rate=None,
        duration_s=result.duration_s,
        requests=result.ok,
        errors=result.errors,
        dropped=0,
        requests_per_s=requests_per_s,
        items_per_s=items_per_s,
        p50_ms=latency.get("p50"),
        p90_ms=latency.get("p90"),
        p99_ms=latency.get("p99"),
        p999_ms=latency.get("p99.9"),
        error_samples=samples,
        cpu_ms_per_request=cpu_per_request(run.cpu_seconds, result.requests),
        fraction_of_inprocess=items_per_s / baseline.best.items_per_s if baseline else None,
        loadgen="wrk",
    )


def h2load_point(
    target: Target,
    request: InferRequest,
    rate: float,
    duration: float,
    warmup: float,
    min_clients: int,
    meter: CpuMeter,
    baseline: Baseline | None,
    log: Log,
) -> Point:
    """A fixed-rate point: ``rate`` requests/s, evenly spaced, for about ``duration``."""
    executable = find_tool("h2load")
    plan = h2load.arrival_plan(rate, min_clients)
    if not plan.even:
        log(f"h2load: no start period up to {h2load.MAX_PERIOD_MS} ms spreads {rate:g}/s evenly")
    parts = split_request(request.raw)
    with tempfile.TemporaryDirectory(prefix="bench-h2load-") as folder:
        body_path, log_path = Path(folder) / "body.bin", Path(folder) / "requests.tsv"
        body_path.write_bytes(parts.body)

        def once(seconds: float, measured: CpuMeter | None) -> ToolRun:
            count = round(rate * seconds)
            line = h2load.command(executable, target.url, parts, body_path, plan, count, log_path)
            return run_tool(line, seconds + plan.ramp_s + RUN_SLACK_S, measured)

        if warmup >= MIN_WARMUP_S:
            once(warmup, None)
        run = once(duration, meter)
        result = h2load.parse_output(run.stdout, log_path.read_text())
    samples = [f"{count} {kind}" for kind, count in result.status_counts.items() if count]
    if result.errored or result.timeout:
        samples.append(f"{result.errored} errored, {result.timeout} timed out")
    load = LoadResult(
        latencies=result.latencies_s,
        errors=result.errors,
        error_samples=samples if result.errors else [],
        elapsed=result.log_span_s or result.elapsed_s,
    )
    point = summarize("open", request.mode, rate, load, request.items, run.cpu_seconds, baseline)
    point.loadgen = "h2load"
    return point
