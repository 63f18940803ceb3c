"""More models than memory: 50 small ONNX models loaded on demand within a quarter of what
they would hold together.

``python -m bench.on_demand`` writes a repository of ``--models`` small ONNX models (an
identity over FP32 [-1, 16]: what each holds is an empty onnxruntime worker), measures what
all of them hold loaded together, and serves the repository with ``--model-control-mode
demand`` and a memory budget of a quarter of that. Then two runs of ``--warmup`` and
``--seconds`` each, at ``--rate`` requests a second (open loop, evenly spaced); cold starts,
evictions and waits count from the end of the warm-up on (the budget has filled and the hot
set formed), answers over the whole run:

1. **Zipf** (s = 1.1) over the models: every request must be answered, the ten hottest must
   never be evicted; cold starts (request arrival to the workers' first heartbeat, from the
   server's log) and the client's latency of the requests that waited for one.
2. **Uniform** over the models, which cannot fit: answered requests per second against the
   budget, evictions, and the shortest time a model stayed loaded before its eviction (thrash
   protection: never below ``SLUICE_MIN_RESIDENCY_S``).

Prints one Markdown table. A smoke run:
``python -m bench.on_demand --models 8 --warmup 5 --seconds 10``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx
import numpy as np

from bench.stack import start_stack, stop_stack

WIDTH = 16
MIB = 1 << 20
HOTTEST = 10
_LOADED = re.compile(
    r"'(m\d+)' version 1 loaded on demand in ([\d.]+) s \(its workers started in ([\d.]+) s\)"
)
_EVICTED = re.compile(r"'(m\d+)' version 1 unloaded to make room")
_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})")


def write_repository(root: Path, count: int) -> list[str]:
    import onnx
    from onnx import TensorProto, helper

    names = [f"m{index:02d}" for index in range(count)]
    for name in names:
        graph = helper.make_graph(
            [helper.make_node("Identity", ["IN"], ["OUT"])],
            name,
            [helper.make_tensor_value_info("IN", TensorProto.FLOAT, [None, WIDTH])],
            [helper.make_tensor_value_info("OUT", TensorProto.FLOAT, [None, WIDTH])],
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        model.ir_version = 9
        (root / name / "1").mkdir(parents=True)
        onnx.save(model, str(root / name / "1" / "model.onnx"))
        (root / name / "config.pbtxt").write_text(
            f'name: "{name}"\nplatform: "onnxruntime_onnx"\nmax_batch_size: 8\n'
            f'input [ {{ name: "IN" data_type: TYPE_FP32 dims: [ {WIDTH} ] }} ]\n'
            f'output [ {{ name: "OUT" data_type: TYPE_FP32 dims: [ {WIDTH} ] }} ]\n'
        )
    return names


REQUEST = {
    "inputs": [{"name": "IN", "datatype": "FP32", "shape": [1, WIDTH], "data": [0.5] * WIDTH}]
}


def used_bytes(url: str) -> int:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    found = re.search(r'^sluice_memory_used_bytes\{device="host",host="[^"]*"\} (\S+)$', text, re.M)
    return int(float(found.group(1))) if found else 0


def all_models_bytes(repository: Path, names: list[str], scratch: Path) -> int:
    """What every model holds, all loaded together, measured by a stack of its own (the
    workers share the pages their fork server imported: together they hold less than
    their number times one alone)."""
    stack = start_stack(
        repository,
        log_path=scratch / "pilot.log",
        extra_args=["--model-control-mode", "demand"],
        env={"SLUICE_BATCH_WORKERS": "0", "SLUICE_MEMORY_BUDGET": "1TiB"},
    )
    try:
        assert stack.url is not None

        async def load_all() -> None:
            async with httpx.AsyncClient(base_url=stack.url or "", timeout=120) as http:
                await asyncio.gather(
                    *(http.post(f"/v2/models/{name}/infer", json=REQUEST) for name in names)
                )

        asyncio.run(load_all())
        time.sleep(3)  # (measured at the ticks after their first heartbeats)
        size = used_bytes(stack.url)
        if not size:
            raise RuntimeError("the pilot stack reported no memory in use")
        return size
    finally:
        stop_stack(stack)


def open_loop(
    url: str, names: list[str], weights: np.ndarray, rate: float, seconds: float, seed: int
) -> tuple[Counter[int], list[tuple[str, float, float]]]:
    """``rate`` requests a second, evenly spaced, each to a model drawn by ``weights``, for
    ``seconds``: status counts and (model, latency s, unix time sent) of every request."""
    rng = np.random.default_rng(seed)
    picks = [names[int(i)] for i in rng.choice(len(names), size=int(rate * seconds), p=weights)]
    codes: Counter[int] = Counter()
    latencies: list[tuple[str, float, float]] = []

    async def one(http: httpx.AsyncClient, name: str, at: float) -> None:
        await asyncio.sleep(max(0.0, at - time.perf_counter()))
        started, sent_at = time.perf_counter(), time.time()
        try:
            code = (await http.post(f"/v2/models/{name}/infer", json=REQUEST)).status_code
        except httpx.HTTPError:
            code = 0
        codes[code] += 1
        latencies.append((name, time.perf_counter() - started, sent_at))

    async def all_of_them() -> None:
        limits = httpx.Limits(max_connections=512, max_keepalive_connections=64)
        async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as http:
            begin = time.perf_counter() + 0.5
            await asyncio.gather(
                *(one(http, name, begin + index / rate) for index, name in enumerate(picks))
            )

    asyncio.run(all_of_them())
    return codes, latencies


def log_events(
    path: Path, since: float
) -> tuple[list[float], list[float], Counter[str], list[float]]:
    """From unix time ``since`` on: cold starts (s: arrival to ready), their workers' start
    (s: started to ready), evictions by model, and each evicted model's time loaded (s)."""
    cold: list[float] = []
    starts: list[float] = []
    evictions: Counter[str] = Counter()
    resident: list[float] = []
    loaded_at: dict[str, float] = {}
    for line in path.read_text(errors="replace").splitlines():
        stamp = _STAMP.match(line)
        when = (
            time.mktime(time.strptime(stamp.group(1)[:19], "%Y-%m-%d %H:%M:%S"))
            + int(stamp.group(1)[20:]) / 1000
            if stamp
            else None
        )
        counted = when is not None and when >= since
        if (found := _LOADED.search(line)) is not None:
            if counted:
                cold.append(float(found.group(2)))
                starts.append(float(found.group(3)))
            if when is not None:
                loaded_at[found.group(1)] = when
        elif (found := _EVICTED.search(line)) is not None:
            if counted:
                evictions[found.group(1)] += 1
            if when is not None and found.group(1) in loaded_at:
                loaded = loaded_at.pop(found.group(1))
                if counted:
                    resident.append(when - loaded)
    return cold, starts, evictions, resident


def run(
    repository: Path,
    names: list[str],
    budget: int,
    weights: np.ndarray,
    args: argparse.Namespace,
    log: Path,
    min_residency_s: float,
) -> dict[str, object]:
    stack = start_stack(
        repository,
        log_path=log,
        extra_args=["--model-control-mode", "demand"],
        env={
            "SLUICE_BATCH_WORKERS": "0",
            "SLUICE_MEMORY_BUDGET": str(budget),
            "SLUICE_MIN_RESIDENCY_S": str(min_residency_s),
            "SLUICE_LOG_LEVEL": "INFO",
        },
    )
    try:
        assert stack.url is not None
        since = time.time() + args.warmup
        started = time.monotonic()
        codes, latencies = open_loop(
            stack.url, names, weights, args.rate, args.warmup + args.seconds, 7
        )
        elapsed = time.monotonic() - started
        peak = used_bytes(stack.url)
    finally:
        stop_stack(stack)
    cold, starts, evictions, resident = log_events(log, since)
    slow = [took for _, took, at in latencies if took > 0.05 and at >= since]  # waited for a load
    return {
        "answered": codes.get(200, 0),
        "failed": sum(count for code, count in codes.items() if code != 200),
        "codes": {str(code): count for code, count in sorted(codes.items())},
        "rate": codes.get(200, 0) / elapsed,
        "cold_p50_ms": statistics.median(cold) * 1000 if cold else float("nan"),
        "cold_count": len(cold),
        "start_p50_ms": statistics.median(starts) * 1000 if starts else float("nan"),
        "waited_p50_ms": statistics.median(slow) * 1000 if slow else float("nan"),
        "evictions": sum(evictions.values()),
        "hot_evicted": sum(evictions[name] for name in names[:HOTTEST]),
        "shortest_residency_s": min(resident) if resident else float("nan"),
        "used_mib": peak / MIB,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", type=int, default=50)
    parser.add_argument("--seconds", type=float, default=60.0, help="measured, per run")
    parser.add_argument(
        "--warmup",
        type=float,
        default=60.0,
        help="seconds of traffic before the measured ones (the budget fills, the hot set "
        "forms, a minute of uses is known)",
    )
    parser.add_argument("--rate", type=float, default=20.0, help="requests per second")
    parser.add_argument(
        "--min-residency",
        type=float,
        default=10.0,
        help="SLUICE_MIN_RESIDENCY_S of the uniform run (thrash protection)",
    )
    parser.add_argument(
        "--zipf-min-residency",
        type=float,
        default=1.0,
        help="SLUICE_MIN_RESIDENCY_S of the Zipf run (its tail rotates through the room)",
    )
    parser.add_argument("--zipf", type=float, default=1.1)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="sluice-on-demand-") as scratch_name:
        scratch = Path(scratch_name)
        repository = scratch / "repository"
        names = write_repository(repository, args.models)
        total = all_models_bytes(repository, names, scratch)
        budget = max(MIB, total // 4)
        ranks = np.arange(1, args.models + 1, dtype=float)
        zipf = ranks**-args.zipf / (ranks**-args.zipf).sum()
        uniform = np.full(args.models, 1 / args.models)
        results = {
            "Zipf": run(
                repository, names, budget, zipf, args, scratch / "zipf.log", args.zipf_min_residency
            ),
            "uniform": run(
                repository,
                names,
                budget,
                uniform,
                args,
                scratch / "uniform.log",
                args.min_residency,
            ),
        }
    print(
        f"{args.models} models, all loaded together hold {total / MIB:.0f} MiB; budget "
        f"{budget / MIB:.0f} MiB; "
        f"{args.rate:.0f} requests/s (open loop), {args.seconds:.0f} s per run, min residency "
        f"{args.zipf_min_residency:g} s (Zipf) and {args.min_residency:g} s (uniform)\n"
    )
    print(
        "| spread | answered | failed | answered/s | cold starts | cold start p50 | "
        "of which starting workers p50 | "
        "waited p50 (client) | evictions | of the 10 hottest | shortest residency | used |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for label, r in results.items():
        print(
            f"| {label} | {r['answered']} | {r['failed']} | {r['rate']:.0f} | {r['cold_count']} "
            f"| {r['cold_p50_ms']:.0f} ms | {r['start_p50_ms']:.0f} ms "
            f"| {r['waited_p50_ms']:.0f} ms | {r['evictions']} "
            f"| {r['hot_evicted']} | {r['shortest_residency_s']:.1f} s | {r['used_mib']:.0f} MiB |"
        )
    print("\n" + json.dumps(results, default=float))


if __name__ == "__main__":
    main()
