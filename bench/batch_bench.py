"""Batch jobs and asynchronous jobs, measured against the engine in the same run.

``python -m bench.batch_bench`` serves a repository like a user's (iris, mlp and cnn loaded,
sluice up's defaults, one batch worker) and measures:

1. the CNN in-process with onnxruntime at its best on this machine (every thread count from
   1 to the cores, its largest batch), then a batch job of CNN rows from ``.npy`` to
   ``.npy``: rows per second from the job's own start and end;
2. the tiny model (mlp): a batch job of a million rows, ``.npy`` to ``.npy``, wall clock from
   submission to the manifest;
3. job submission (``Prefer: respond-async``, 202) against synchronous requests (200) on
   mlp, the same closed loop;
4. online p99 of CNN requests alone, then while a CNN batch job runs.

Prints one Markdown report; numbers only, no tuning of either side.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench import loadgen
from bench.baseline import make_session, random_feed, time_batch
from bench.client import Target, get_json, model_path, parse_target, wait_until_ready
from bench.payload import build_request
from bench.stack import start_stack, stop_stack
from sluice.client import Client

EXAMPLES = Path(__file__).resolve().parents[1] / "model_repository"
MODELS = ("iris", "mlp", "cnn")


def engine_best(model: Path, batch: int) -> tuple[float, int]:
    """The best items/s of the model in-process at ``batch``, and the thread count."""
    best = (0.0, 1)
    rng = np.random.default_rng(0)
    for threads in range(1, (os.cpu_count() or 1) + 1):
        session = make_session(model, threads)
        point = time_batch(session, random_feed(session, batch, True, rng), batch, 3.0)
        best = max(best, (point.items_per_s, threads))
    return best


def run_batch(client: Client, model: str, source: Path, target: Path) -> dict[str, Any]:
    submitted = time.monotonic()
    state = client.submit_batch(model, str(source), str(target))
    while state["status"] not in ("completed", "failed", "cancelled"):
        time.sleep(0.2)
        state = client.batch(state["id"])
    state["wall_s"] = time.monotonic() - submitted
    if state["status"] != "completed":
        raise RuntimeError(f"the batch job did not complete: {state}")
    return state


def closed(target: Target, raw: bytes, concurrency: int, seconds: float, ok: int) -> Any:
    return loadgen.run(loadgen.closed_loop(target, raw, concurrency, seconds, ok=frozenset({ok})))


def with_header(raw: bytes, header: str) -> bytes:
    head, _, rest = raw.partition(b"\r\n")
    return head + b"\r\n" + header.encode() + b"\r\n" + rest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cnn-rows", type=int, default=8_000)
    parser.add_argument("--mlp-rows", type=int, default=1_000_000)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument(
        "--threads", type=int, default=0, help="SLUICE_THREADS for the stack (0: its default)"
    )
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="sluice-batch-bench-"))
    repository = work / "models"
    for name in MODELS:
        shutil.copytree(EXAMPLES / name, repository / name)
    data = work / "data"
    data.mkdir()
    rng = np.random.default_rng(1)
    np.save(data / "images.npy", rng.standard_normal((args.cnn_rows, 3, 64, 64), dtype=np.float32))
    np.save(data / "rows.npy", rng.standard_normal((args.mlp_rows, 16), dtype=np.float32))

    engine, threads = engine_best(repository / "cnn" / "1" / "model.onnx", 32)
    env = {"SLUICE_BATCH_ROOT": str(data)}
    if args.threads:
        env["SLUICE_THREADS"] = str(args.threads)
    stack = start_stack(repository, env=env)
    try:
        assert stack.url is not None
        target = parse_target(stack.url)
        for name in MODELS:
            wait_until_ready(target, name)
        client = Client(stack.url, timeout_s=120)
        cnn = run_batch(client, "cnn", data / "images.npy", data / "images-out")
        cnn_rate = cnn["rows_total"] / (cnn["finished"] - cnn["started"])
        mlp = run_batch(client, "mlp", data / "rows.npy", data / "rows-out")

        metadata = get_json(target, model_path("mlp"))
        request = build_request(target, "mlp", metadata, 256, "binary")
        sync = closed(target, request.raw, args.concurrency, args.seconds, 200)
        jobs = closed(
            target,
            with_header(request.raw, "Prefer: respond-async"),
            args.concurrency,
            args.seconds,
            202,
        )

        cnn_meta = get_json(target, model_path("cnn"))
        cnn_request = build_request(target, "cnn", cnn_meta, 32, "binary")
        alone = closed(target, cnn_request.raw, 2, args.seconds, 200)
        background = client.submit_batch("cnn", str(data / "images.npy"), str(data / "bg-out"))
        time.sleep(2)
        under = closed(target, cnn_request.raw, 2, args.seconds, 200)
        client.cancel_batch(background["id"])
        client.close()
    finally:
        stop_stack(stack)
        shutil.rmtree(work, ignore_errors=True)

    def p(result: Any, q: float) -> float:
        return loadgen.percentiles_ms(result.latencies, (q,))[0] or float("nan")

    def rate(result: Any) -> float:
        return len(result.latencies) / args.seconds

    threads_note = f"SLUICE_THREADS={args.threads}" if args.threads else "default threads"
    print(f"## Batch and asynchronous jobs ({os.cpu_count()} cores, {threads_note})\n")
    print("| measure | Sluice | baseline, same run | ratio |")
    print("| --- | --- | --- | --- |")
    print(
        f"| CNN batch job, {args.cnn_rows:,} rows `.npy` → `.npy` | {cnn_rate:,.0f} rows/s | "
        f"onnxruntime in-process, batch 32, best of 1..{os.cpu_count()} threads ({threads}): "
        f"{engine:,.0f} items/s | {cnn_rate / engine:.2f} |"
    )
    print(
        f"| mlp batch job, {args.mlp_rows:,} rows, submission to manifest | "
        f"{args.mlp_rows / mlp['wall_s']:,.0f} rows/s ({mlp['wall_s']:.1f} s) | target 50,000 "
        f"rows/s | {args.mlp_rows / mlp['wall_s'] / 50_000:.1f} |"
    )
    print(
        f"| mlp job submissions (202), c={args.concurrency} | {rate(jobs):,.0f}/s | synchronous "
        f"requests (200): {rate(sync):,.0f}/s | {rate(jobs) / rate(sync):.2f} |"
    )
    print(
        f"| CNN online p99, c=2, under a CNN batch job | {p(under, 99):.1f} ms "
        f"(p50 {p(under, 50):.1f}) | alone: {p(alone, 99):.1f} ms (p50 {p(alone, 50):.1f}) | "
        f"{p(under, 99) / p(alone, 99):.2f} |"
    )
    errors = jobs.errors + sync.errors + alone.errors + under.errors
    print(f"\nErrors: {errors}.")


if __name__ == "__main__":
    main()
