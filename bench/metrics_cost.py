"""What metrics cost: the tiny model's throughput with metrics on (and scraped) and off.

``python -m bench.metrics_cost`` starts a stack on the example repository with the defaults
(metrics on) or with ``SLUICE_ALLOW_METRICS=false``, one at a time, in alternating rounds
(ABBA...) so that drift of the machine falls on both alike, and reports throughput and the
stack's CPU time per request (less noisy on a shared machine). While the
metrics-on stack is loaded, ``/metrics`` is scraped every second by default (Prometheus'
default is every 15 s: this is harsher; ``--scrape-every 0`` measures the recording alone).
Prints each round and a Markdown table of the medians.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import urllib.request
from pathlib import Path

from bench import loadgen
from bench.client import Target, get_json, model_path, wait_until_ready
from bench.cpu import CpuMeter
from bench.payload import build_request
from bench.stack import start_stack, stop_stack


def _scrape_every(url: str, period_s: float, stop_at: float) -> None:
    while time.monotonic() < stop_at:
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
            response.read()
        time.sleep(period_s)


async def _round(
    target: Target, raw: bytes, concurrency: int, duration: float, scrape_s: float, meter: CpuMeter
) -> tuple[float, int]:
    scraper = None
    if scrape_s > 0:
        stop_at = time.monotonic() + duration + 1.5
        url = f"http://{target.host}:{target.port}"
        scraper = asyncio.create_task(asyncio.to_thread(_scrape_every, url, scrape_s, stop_at))
    result = await loadgen.closed_loop(
        target, raw, concurrency, duration, warmup=1.0, on_window=meter.on_window
    )
    if scraper is not None:
        await scraper
    if result.errors:
        raise RuntimeError(f"{result.errors} errors: {result.error_samples[:3]}")
    return len(result.latencies) / result.elapsed, len(result.latencies)


def _measure(args: argparse.Namespace, label: str) -> tuple[float, float]:
    """Start a stack, load it once, stop it: (requests/s, stack CPU microseconds per request)."""
    env = {} if label == "on" else {"SLUICE_ALLOW_METRICS": "false"}
    stack = start_stack(args.model_repository, env=env)
    try:
        target = Target("127.0.0.1", stack.port)
        wait_until_ready(target, args.model)
        metadata = get_json(target, model_path(args.model))
        config = get_json(target, model_path(args.model, "/config"))
        request = build_request(
            target, args.model, metadata, int(config.get("max_batch_size", 0)), "binary"
        )
        meter = CpuMeter(stack.pid)
        scrape_s = args.scrape_every if label == "on" else 0.0
        rate, completed = loadgen.run(
            _round(target, request.raw, args.concurrency, args.duration, scrape_s, meter)
        )
        cpu_s = sum(v for group, v in (meter.last or {}).items() if group != "loadgen")
        return rate, cpu_s / max(1, completed) * 1e6
    finally:
        stop_stack(stack)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--duration", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument(
        "--scrape-every", type=float, default=1.0, help="seconds between scrapes (0: none)"
    )
    parser.add_argument("--model-repository", type=Path, default=Path("model_repository"))
    args = parser.parse_args()

    rates: dict[str, list[float]] = {"on": [], "off": []}
    costs: dict[str, list[float]] = {"on": [], "off": []}
    for index in range(args.rounds):
        for label in ["on", "off"] if index % 2 == 0 else ["off", "on"]:
            rate, cost = _measure(args, label)
            rates[label].append(rate)
            costs[label].append(cost)
            print(
                f"round {index + 1} metrics {label}: {rate:,.0f} requests/s, "
                f"{cost:,.0f} us of stack CPU per request",
                flush=True,
            )
    on, off = statistics.median(rates["on"]), statistics.median(rates["off"])
    cost_on, cost_off = statistics.median(costs["on"]), statistics.median(costs["off"])
    scraped = f"scraped every {args.scrape_every:g} s" if args.scrape_every else "not scraped"
    print()
    print(
        f"| {args.model}, binary, c={args.concurrency}, medians of {args.rounds} "
        "| requests/s | stack CPU per request |"
    )
    print("| --- | --- | --- |")
    print(f"| metrics on, {scraped} | {on:,.0f} | {cost_on:,.0f} us |")
    print(f"| metrics off | {off:,.0f} | {cost_off:,.0f} us |")
    print(f"| on ÷ off | {on / off:.3f} | {cost_on / cost_off:.3f} |")


if __name__ == "__main__":
    main()
