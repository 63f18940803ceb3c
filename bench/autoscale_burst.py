"""A burst against the CNN: how long until p99 is back under the objective, with one fixed
instance, with the maximum fixed from the start, and with autoscaling between the two.

``python -m bench.autoscale_burst`` first measures what one instance answers (closed loop),
then, for each configuration in turn (a stack of its own on a repository holding only the
cnn model), sends an open-loop load: 10 % of that capacity, a burst at 300 %, then 10 %
again. Each second's p99 is computed from the requests scheduled in it (latency counted
from the scheduled time, so waiting to be sent counts); "recovered" is the end of the first
second after the burst began from which every later second's p99 stays under the objective.
Prints one Markdown table; requests refused (503, a full queue) are counted, not hidden.
"""

from __future__ import annotations

import argparse
import math
import tempfile
from pathlib import Path

from bench import loadgen
from bench.client import Target, get_json, model_path, wait_until_ready
from bench.payload import build_request
from bench.stack import cnn_repository, start_stack, stop_stack

AUTOSCALE = """
parameters {{ key: "sluice.min_instances" value {{ string_value: "1" }} }}
parameters {{ key: "sluice.max_instances" value {{ string_value: "{maximum}" }} }}
parameters {{ key: "sluice.latency_objective_ms" value {{ string_value: "{objective_ms}" }} }}
parameters {{ key: "sluice.scale_down_window_s" value {{ string_value: "10" }} }}
"""


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]


def _recovery_s(
    trace: loadgen.Trace, burst_start: float, objective_s: float, end: float
) -> float | None:
    """Seconds from the burst's start to the end of the first second after which every
    second's p99 stays under the objective; None if it never does."""
    seconds: dict[int, list[float]] = {}
    for at, latency, status in trace.sent:
        if status == 200:
            seconds.setdefault(int(at), []).append(latency)
    first = int(burst_start)
    last = int(end)
    recovered: int | None = None
    for second in range(first, last):
        values = seconds.get(second, [])
        if values and _p99(values) > objective_s:
            recovered = None
        elif recovered is None:
            recovered = second
    return None if recovered is None else recovered - burst_start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-repository", type=Path, default=Path("model_repository"))
    parser.add_argument("--max-instances", type=int, default=2)
    parser.add_argument("--objective-ms", type=float, default=1000.0)
    parser.add_argument("--low-s", type=float, default=10.0)
    parser.add_argument("--burst-s", type=float, default=15.0)
    parser.add_argument("--after-s", type=float, default=30.0)
    args = parser.parse_args()
    objective_s = args.objective_ms / 1000
    configurations = {
        "1 instance, fixed": ("", 1),
        f"{args.max_instances} instances, fixed": ("", args.max_instances),
        f"autoscaling 1..{args.max_instances}": (
            AUTOSCALE.format(maximum=args.max_instances, objective_ms=int(args.objective_ms)),
            1,
        ),
    }
    rows: list[str] = []
    capacity = 0.0
    with tempfile.TemporaryDirectory(prefix="sluice-burst-") as scratch:
        for index, (label, (extra, count)) in enumerate(configurations.items()):
            root = cnn_repository(args.model_repository, Path(scratch) / str(index), count, extra)
            stack = start_stack(root)
            try:
                target = Target("127.0.0.1", stack.port)
                wait_until_ready(target, "cnn")
                metadata = get_json(target, model_path("cnn"))
                request = build_request(target, "cnn", metadata, 8, "binary")
                if not capacity:  # one instance's answers per second, closed loop
                    result = loadgen.run(loadgen.closed_loop(target, request.raw, 8, 6.0))
                    capacity = len(result.latencies) / result.elapsed
                    print(f"one instance answers {capacity:.0f} requests/s", flush=True)
                low, high = 0.1 * capacity, 3.0 * capacity
                phases = [(args.low_s, low), (args.burst_s, high), (args.after_s, low)]
                trace = loadgen.run(loadgen.open_loop_phases(target, request.raw, phases, 300))
            finally:
                stop_stack(stack)
            end = args.low_s + args.burst_s + args.after_s
            recovery = _recovery_s(trace, args.low_s, objective_s, end)
            burst = [
                lat
                for at, lat, status in trace.sent
                if status == 200 and args.low_s <= at < args.low_s + args.burst_s
            ]
            refused = sum(1 for _, _, status in trace.sent if status != 200)
            shown = "never" if recovery is None else f"{recovery:.0f} s"
            p99_ms = _p99(burst) * 1000 if burst else math.nan
            rows.append(f"| {label} | {shown} | {p99_ms:.0f} ms | {refused} of {len(trace.sent)} |")
            print(rows[-1], flush=True)
    print()
    print(
        f"Burst: {0.1 * capacity:.0f} → {3 * capacity:.0f} → {0.1 * capacity:.0f} requests/s "
        f"({args.low_s:g} s, {args.burst_s:g} s, {args.after_s:g} s); objective p99 "
        f"{args.objective_ms:g} ms"
    )
    print()
    print(
        "| cnn | p99 back under the objective, from the burst's start "
        "| p99 during the burst | not answered 200 |"
    )
    print("| --- | --- | --- | --- |")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
