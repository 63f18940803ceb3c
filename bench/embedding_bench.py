"""``python -m bench.embedding_bench``: sentence embeddings served against in-process.

``sluice up`` over the example repository (or ``--url``, a running server) and, in the
same run, the same pipeline in-process (:class:`examples.minilm_reference.ServedPipeline`:
the tokenizer step's ``model.py``, then the transformer and pooling ONNX files in
onnxruntime).

- served: KServe v2 JSON, one sentence per request (``TEXT`` BYTES [1,1]), closed loop at
  each concurrency (1, 16, 64), one keep-alive connection per client; the sentences (a
  seeded mix of 4 to 48 words) are sent round-robin, so batches mix lengths as real
  traffic does. Every answer of the default model is checked against the in-process
  embedding of its sentence (cosine above 1 - 1e-4); for another ``--model`` only the
  status and the named ``--output`` are checked (so the tokenizer, the first step, can be
  measured alone).
- in-process: batches of 1 and of ``--batch`` sentences, back to back, with onnxruntime on
  1 intra-op thread and on every usable core; the best setting of each is reported.

Prints a Markdown table: sentences/s, p50 and p99 per request (per batch in-process).
The load generator shares the machine's cores with the stack.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench import loadgen
from bench.client import HttpConnection, Target, connect, encode_request, model_path
from bench.loadgen import percentiles_ms
from bench.stack import start_stack, stop_stack
from sluice.core.runtime import usable_cores

DEFAULT_MODEL = "minilm_embedding"
COSINE_TOLERANCE = 1e-4
_VOCABULARY = (
    "the a model server batches requests from many clients into one run and answers each "
    "of them quickly while the queue keeps every message safe sentence embedding search "
    "retrieval question answer document river mountain city music coffee morning quiet "
    "bright data network memory thread core latency throughput"
)
WORDS = _VOCABULARY.split()


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _ints(text: str) -> list[int]:
    values = [int(part) for part in text.split(",") if part.strip()]
    if not values or any(value < 1 for value in values):
        raise argparse.ArgumentTypeError("values must be positive integers")
    return values


def sentences(count: int, seed: int = 384) -> list[str]:
    """``count`` seeded sentences of 4 to 48 words."""
    rng = np.random.default_rng(seed)
    return [
        " ".join(rng.choice(WORDS, size=int(rng.integers(4, 49)))).capitalize() + "."
        for _ in range(count)
    ]


@dataclass
class Row:
    """One line of the table."""

    path: str  # "served" or "in-process"
    load: str  # "c=16" or "batch 64, 2 threads"
    sentences_per_s: float
    p50_ms: float | None
    p99_ms: float | None
    errors: int = 0


# ----------------------------------------------------------------------------- in-process


def measure_in_process(
    pipeline: Any, texts: Sequence[str], batch: int, seconds: float, warmup: int = 2
) -> Row:
    """``pipeline.embed`` on consecutive slices of ``batch`` sentences for ``seconds``."""
    for index in range(warmup):
        pipeline.embed(_slice(texts, index * batch, batch))
    latencies: list[float] = []
    done = 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds or not latencies:
        began = time.perf_counter()
        pipeline.embed(_slice(texts, done, batch))
        latencies.append(time.perf_counter() - began)
        done += batch
    elapsed = time.perf_counter() - start
    p50, p99 = percentiles_ms(latencies, (50.0, 99.0))
    return Row("in-process", f"batch {batch}", done / elapsed, p50, p99)


def _slice(texts: Sequence[str], start: int, count: int) -> list[str]:
    return [texts[(start + offset) % len(texts)] for offset in range(count)]


def in_process_rows(
    repository: Path,
    texts: Sequence[str],
    batches: Sequence[int],
    seconds: float,
    thread_settings: Sequence[int],
) -> tuple[list[Row], dict[str, np.ndarray]]:
    """The best thread setting for each batch size; and each sentence's embedding."""
    from examples.minilm_reference import ServedPipeline

    best: dict[int, Row] = {}
    expected: dict[str, np.ndarray] = {}
    for threads in thread_settings:
        pipeline = ServedPipeline(repository, threads=threads)
        if not expected:
            expected = dict(zip(texts, pipeline.embed(texts), strict=True))
        for batch in batches:
            row = measure_in_process(pipeline, texts, batch, seconds)
            row.load = f"batch {batch}, {threads} thread{'s' if threads > 1 else ''}"
            log(f"in-process {row.load}: {row.sentences_per_s:.1f} sentences/s")
            if batch not in best or row.sentences_per_s > best[batch].sentences_per_s:
                best[batch] = row
    return [best[batch] for batch in batches], expected


# ----------------------------------------------------------------------------- served


def request_body(sentence: str, input_name: str = "TEXT") -> bytes:
    tensor = {"name": input_name, "shape": [1, 1], "datatype": "BYTES", "data": [sentence]}
    return json.dumps({"inputs": [tensor]}).encode()


def check_answer(
    body: bytes, output: str, expected: np.ndarray | None, tolerance: float = COSINE_TOLERANCE
) -> str | None:
    """None if ``body`` carries ``output`` (and, with ``expected``, that embedding)."""
    try:
        outputs = {o["name"]: o for o in json.loads(body)["outputs"]}
    except (ValueError, KeyError, TypeError) as exc:
        return f"not a KServe v2 answer: {exc}"
    if output not in outputs:
        return f"no output '{output}' in {sorted(outputs)}"
    if expected is None:
        return None
    answer = np.asarray(outputs[output]["data"], dtype=np.float32)
    if answer.shape != expected.shape:
        return f"'{output}' has {answer.size} values, expected {expected.size}"
    cosine = float(answer @ expected) / float(np.linalg.norm(answer) * np.linalg.norm(expected))
    return None if cosine > 1 - tolerance else f"cosine {cosine:.6f} to the in-process embedding"


async def served_point(
    target: Target,
    args: argparse.Namespace,
    texts: Sequence[str],
    expected: dict[str, np.ndarray],
    concurrency: int,
) -> Row:
    path = model_path(args.model, "/infer")
    headers = {"Content-Type": "application/json"}
    raws = [
        (text, encode_request(target, "POST", path, request_body(text, args.input), headers))
        for text in texts
    ]
    idle: list[HttpConnection] = []
    counter = iter(range(1 << 62))

    async def call() -> str | None:
        text, raw = raws[next(counter) % len(raws)]
        connection = idle.pop() if idle else await connect(target)
        try:
            status, body = await connection.request(raw)
        except BaseException:
            connection.close()
            raise
        if not connection.closed:
            idle.append(connection)
        if status != 200:
            return f"HTTP {status}: {body[:200].decode(errors='replace')}"
        return check_answer(body, args.output, expected.get(text))

    try:
        result = await loadgen.closed_loop_calls(
            call, concurrency, args.duration, warmup=args.warmup
        )
    finally:
        for connection in idle:
            connection.close()
    p50, p99 = percentiles_ms(result.latencies, (50.0, 99.0))
    for sample in result.error_samples:
        log(f"  error: {sample}")
    rate = len(result.latencies) / result.elapsed if result.elapsed > 0 else 0.0
    return Row("served", f"c={concurrency}", rate, p50, p99, result.errors)


def served_rows(
    target: Target, args: argparse.Namespace, texts: Sequence[str], expected: dict[str, Any]
) -> list[Row]:
    checked = expected if args.model == DEFAULT_MODEL else {}
    rows = []
    for concurrency in args.concurrency:
        row = loadgen.run(served_point(target, args, texts, checked, concurrency))
        log(f"served {row.load}: {row.sentences_per_s:.1f} sentences/s, {row.errors} errors")
        rows.append(row)
    return rows


# ----------------------------------------------------------------------------- report


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def markdown(model: str, rows: Sequence[Row]) -> str:
    lines = [
        f"### Sentence embeddings: `{model}` served against the pipeline in-process",
        "",
        "| path | load | sentences/s | p50 ms | p99 ms | errors |",
        "|------|------|------------:|-------:|-------:|-------:|",
    ]
    lines += [
        f"| {r.path} | {r.load} | {r.sentences_per_s:.1f} | {_ms(r.p50_ms)} | "
        f"{_ms(r.p99_ms)} | {r.errors} |"
        for r in rows
    ]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.embedding_bench", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--model", default=DEFAULT_MODEL, help="served model (default %(default)s)")
    parser.add_argument("--input", default="TEXT", help="its BYTES input (default %(default)s)")
    parser.add_argument(
        "--output", default="EMBEDDING", help="output each answer must carry (default %(default)s)"
    )
    parser.add_argument("--concurrency", type=_ints, default=[1, 16, 64])
    parser.add_argument("--duration", type=float, default=10.0, help="measured seconds per point")
    parser.add_argument("--warmup", type=float, default=2.0, help="uncounted seconds per point")
    parser.add_argument("--batch", type=int, default=64, help="in-process batch besides 1")
    parser.add_argument(
        "--threads",
        type=_ints,
        default=None,
        help="onnxruntime intra-op threads to try in-process (default: 1 and every core)",
    )
    parser.add_argument("--sentences", type=int, default=256, help="distinct sentences")
    parser.add_argument("--model-repository", type=Path, default=Path("model_repository"))
    parser.add_argument("--url", help="a running server (http://127.0.0.1:PORT) instead")
    parser.add_argument("--no-served", action="store_true", help="in-process only")
    parser.add_argument("--no-in-process", action="store_true", help="served only")
    parser.add_argument("--out", type=Path, help="also write the rows as JSON")
    args = parser.parse_args(argv)
    if args.duration <= 0 or args.warmup < 0 or args.batch < 1 or args.sentences < 1:
        parser.error("--duration, --batch and --sentences must be positive, --warmup >= 0")
    if args.no_served and args.no_in_process:
        parser.error("--no-served and --no-in-process leave nothing to measure")
    if args.url is not None:
        from bench.client import parse_target

        try:
            args.target = parse_target(args.url)
        except ValueError as exc:
            parser.error(str(exc))
    if args.threads is None:
        cores = usable_cores()
        args.threads = sorted({1, cores})
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    texts = sentences(args.sentences)
    rows: list[Row] = []
    expected: dict[str, np.ndarray] = {}
    if not args.no_in_process:
        seconds = min(args.duration, 5.0)
        in_process, expected = in_process_rows(
            args.model_repository, texts, sorted({1, args.batch}), seconds, args.threads
        )
        rows += in_process
    if not args.no_served:
        stack = None
        if args.url is None:
            log(f"starting sluice up --model-repository {args.model_repository}")
            stack = start_stack(args.model_repository)
            target = Target("127.0.0.1", stack.port)
        else:
            target = args.target
        try:
            from bench.client import wait_until_ready

            wait_until_ready(target, args.model)
            rows = served_rows(target, args, texts, expected) + rows
        finally:
            if stack is not None:
                log(f"stopping the stack (exit status {stop_stack(stack)})")
    print(markdown(args.model, rows))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps([vars(row) for row in rows], indent=2) + "\n")
    return 1 if any(row.errors for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
