"""What metrics cost: the tiny model's throughput with metrics on (and scraped) and off.

``python -m bench.metrics_cost`` starts two stacks on the example repository, one with the
defaults (metrics on) and one with ``SLUICE_ALLOW_METRICS=false``, and loads them in
alternating rounds (ABBA...) so that drift of the machine falls on both alike. While the
metrics-on stack is loaded, ``/metrics`` is scraped every second (Prometheus' default is
every 15 s: this is harsher). Prints a Markdown table of the rounds and the medians.
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
from bench.payload import build_request
from bench.stack import Stack, start_stack, stop_stack


def _scrape_every(url: str, period_s: float, stop_at: float) -> None:
    while time.monotonic() < stop_at:
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
            response.read()
        time.sleep(period_s)


async def _round(
    target: Target, raw: bytes, concurrency: int, duration: float, scrape: bool
) -> float:
    scraper = None
    if scrape:
        stop_at = time.monotonic() + duration + 1.5
        url = f"http://{target.host}:{target.port}"
        scraper = asyncio.create_task(asyncio.to_thread(_scrape_every, url, 1.0, stop_at))
    result = await loadgen.closed_loop(target, raw, concurrency, duration, warmup=1.0)
    if scraper is not None:
        await scraper
    if result.errors:
        raise RuntimeError(f"{result.errors} errors: {result.error_samples[:3]}")
    return len(result.latencies) / result.elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--duration", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--model-repository", type=Path, default=Path("model_repository"))
    args = parser.parse_args()

    stacks: dict[str, Stack] = {}
    try:
        stacks["on"] = start_stack(args.model_repository)
        stacks["off"] = start_stack(args.model_repository, env={"SLUICE_ALLOW_METRICS": "false"})
        targets = {label: Target("127.0.0.1", stack.port) for label, stack in stacks.items()}
        for target in targets.values():
            wait_until_ready(target, args.model)
        target = targets["on"]
        metadata = get_json(target, model_path(args.model))
        config = get_json(target, model_path(args.model, "/config"))
        request = build_request(
            target, args.model, metadata, int(config.get("max_batch_size", 0)), "binary"
        )
        rates: dict[str, list[float]] = {"on": [], "off": []}
        for index in range(args.rounds):
            order = ["on", "off"] if index % 2 == 0 else ["off", "on"]
            for label in order:
                rate = loadgen.run(
                    _round(
                        targets[label], request.raw, args.concurrency, args.duration, label == "on"
                    )
                )
                rates[label].append(rate)
                print(f"round {index + 1} metrics {label}: {rate:,.0f} requests/s", flush=True)
        on, off = statistics.median(rates["on"]), statistics.median(rates["off"])
        print()
        print(
            f"| {args.model}, binary, c={args.concurrency} | requests/s (median of {args.rounds}) |"
        )
        print("| --- | --- |")
        print(f"| metrics on, scraped every 1 s | {on:,.0f} |")
        print(f"| metrics off | {off:,.0f} |")
        print(f"| on ÷ off | {on / off:.3f} |")
    finally:
        for stack in stacks.values():
            stop_stack(stack)


if __name__ == "__main__":
    main()
