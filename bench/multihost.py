"""``python -m bench.multihost``: one gateway host and one worker host against two of each.

The "Several hosts" layout (docs/operations/several-hosts.md) on test hosts (network
namespaces joined by veth links, :mod:`tests.support.netns`; root needed): Redis alone on
one host, gateways on hosts with a front link (the load generator's network) and a back link
(Redis's), worker hosts running ``sluice up --no-gateway --no-controller`` on the whole
example repository with every setting at its default. Layouts are measured one after the
other, in alternating order over ``--rounds`` so that drift of the machine falls on each
alike: for each concurrency, a closed loop of batch-1 binary requests to ``--model`` (2 s
warm-up, ``--duration`` measured), the connections split evenly over the gateways, every
answer's status checked.

All hosts share this machine's cores, so more hosts add processes, not cores: the report
gives the CPU each request cost, by role (gateway, worker, Redis, load generator) beside
requests/s, which is what tells how a layout would scale on machines of its own. The
engine alone (onnxruntime in-process at its best thread setting) is measured in the same
run for reference.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import sys
import tempfile
from dataclasses import asdict, dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

from bench import loadgen
from bench.baseline import config_max_batch_size, latest_model_file, run_best_baseline
from bench.client import get_json, model_path, parse_target
from bench.cpu import CpuMeter
from bench.payload import build_request
from bench.report import summarize

LAYOUTS = ((1, 1), (2, 2))
"""(gateway hosts, worker hosts)."""
CPU_COLUMNS = ("stack", "gateway", "worker", "redis", "other", "loadgen")


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@dataclass
class Measurement:
    gateways: int
    worker_hosts: int
    round: int
    concurrency: int
    requests_per_s: float
    p50_ms: float | None
    p99_ms: float | None
    errors: int
    cpu_us_per_request: dict[str, float]


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.multihost", description=__doc__)
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--model-repository", type=Path, default=Path("model_repository"))
    parser.add_argument("--concurrency", default="16,64")
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("bench/out/multihost"))
    return parser.parse_args(argv)


async def _closed_loops(
    targets: list[Any], raw: list[bytes], concurrency: int, args: argparse.Namespace, meter: Any
) -> loadgen.LoadResult:
    """``concurrency`` connections split evenly over ``targets``, measured as one load."""
    shares = [
        concurrency // len(targets) + (i < concurrency % len(targets)) for i in range(len(targets))
    ]
    results = await asyncio.gather(
        *(
            loadgen.closed_loop(
                target,
                request,
                share,
                args.duration,
                args.warmup,
                meter.on_window if index == 0 else None,
            )
            for index, (target, request, share) in enumerate(zip(targets, raw, shares, strict=True))
            if share
        )
    )
    merged = results[0]
    for other in results[1:]:
        merged.latencies.extend(other.latencies)
        merged.errors += other.errors
        merged.error_samples.extend(other.error_samples)
    return merged


def _measure_layout(
    args: argparse.Namespace, gateways: int, worker_hosts: int, rounds: int
) -> list[Measurement]:
    from tests.support.multihost import Deployment
    from tests.support.netns import HostNetwork

    found: list[Measurement] = []
    with tempfile.TemporaryDirectory(prefix="sluice-hosts-") as scratch, HostNetwork() as net:
        deployment = Deployment(
            net, args.model_repository.resolve(), Path(scratch), gateways, worker_hosts
        )
        try:
            deployment.start(timeout_s=300)
            deployment.wait_for_workers(args.model, 1, timeout_s=300)
            own = frozenset(host.address("front") for host in deployment.gateway_hosts)
            targets = [parse_target(deployment.gateway_url(i), own) for i in range(gateways)]
            metadata = get_json(targets[0], model_path(args.model))
            max_batch = int(
                get_json(targets[0], model_path(args.model, "/config"))["max_batch_size"]
            )
            raw = [build_request(t, args.model, metadata, max_batch, "binary").raw for t in targets]
            roots = tuple(p.process.pid for p in deployment.processes)
            for concurrency in args.concurrency:
                meter = CpuMeter(None, roots)
                result = loadgen.run(_closed_loops(targets, raw, concurrency, args, meter))
                point = summarize("closed", "binary", concurrency, result, 1, meter.last, None)
                cpu_us = {
                    group: round(ms * 1000, 1)
                    for group, ms in (point.cpu_ms_per_request or {}).items()
                }
                found.append(
                    Measurement(
                        gateways,
                        worker_hosts,
                        rounds,
                        concurrency,
                        point.requests_per_s,
                        point.p50_ms,
                        point.p99_ms,
                        point.errors,
                        cpu_us,
                    )
                )
                log(
                    f"{gateways} gateway host(s) + {worker_hosts} worker host(s), c={concurrency}: "
                    f"{point.requests_per_s:,.0f} req/s, p50 {point.p50_ms or 0:.2f} ms, "
                    f"p99 {point.p99_ms or 0:.2f} ms, errors {point.errors}, "
                    f"CPU/request {cpu_us.get('stack', 0):.0f} µs (+{cpu_us.get('loadgen', 0):.0f} "
                    "µs load generator)"
                )
        finally:
            deployment.stop()
    return found


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _row(rows: list[Measurement]) -> str:
    """One table row: a layout at one concurrency, over its rounds."""
    first = rows[0]
    cpu = {g: _mean([m.cpu_us_per_request.get(g, 0.0) for m in rows]) for g in CPU_COLUMNS}
    hosts = f"{first.gateways} gateway + {first.worker_hosts} worker host"
    cells = [
        hosts + ("s" if first.worker_hosts > 1 else ""),
        str(first.concurrency),
        " / ".join(f"{m.requests_per_s:,.0f}" for m in rows),
        f"{_mean([m.p50_ms or 0.0 for m in rows]):.2f}",
        f"{_mean([m.p99_ms or 0.0 for m in rows]):.2f}",
        " / ".join(f"{cpu[g]:.0f}" for g in CPU_COLUMNS[:-1]),
        f"{cpu['loadgen']:.0f}",
        str(sum(m.errors for m in rows)),
    ]
    return "| " + " | ".join(cells) + " |"


def _markdown(measurements: list[Measurement], baseline_items_per_s: float, threads: int) -> str:
    lines = [
        f"In-process onnxruntime at its best ({threads} thread(s), its best batch size): "
        f"{baseline_items_per_s:,.0f} items/s.",
        "",
        "| layout | c | requests/s (each round) | p50 ms | p99 ms | CPU µs per request: "
        "stack / gateway / worker / Redis / other | load generator | errors |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for key in sorted({(m.gateways, m.worker_hosts, m.concurrency) for m in measurements}):
        lines.append(
            _row([m for m in measurements if (m.gateways, m.worker_hosts, m.concurrency) == key])
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    args.concurrency = [int(part) for part in args.concurrency.split(",") if part]
    if os.geteuid() != 0:
        log("bench.multihost needs root: it makes network namespaces and veth links")
        return 2
    model_file = latest_model_file(args.model_repository, args.model)
    baseline = run_best_baseline(
        model_file, config_max_batch_size(args.model_repository, args.model)
    )
    log(
        f"in-process onnxruntime at its best: {baseline.best.items_per_s:,.0f} items/s "
        f"(batch {baseline.best.batch}, {baseline.threads} thread(s))"
    )
    measurements: list[Measurement] = []
    for round_index in range(args.rounds):
        order = LAYOUTS if round_index % 2 == 0 else tuple(reversed(LAYOUTS))
        for gateways, worker_hosts in order:
            measurements += _measure_layout(args, gateways, worker_hosts, round_index)
    report = _markdown(measurements, baseline.best.items_per_s, baseline.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.platform()}",
        "python": platform.python_version(),
        "onnxruntime": version("onnxruntime"),
        "redis-py": version("redis"),
        "model": args.model,
        "duration_s": args.duration,
    }
    (args.out / "results.json").write_text(
        json.dumps({"meta": meta, "measurements": [asdict(m) for m in measurements]}, indent=2)
    )
    print(json.dumps(meta))
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
