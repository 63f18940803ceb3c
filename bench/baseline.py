"""In-process onnxruntime baseline: the same model file, no serving stack around it."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from time import perf_counter, process_time, sleep

import numpy as np
import onnxruntime as ort

from sluice.core.runtime import usable_cores

WARMUP_RUNS = 3
MIN_RUNS = 5

_ORT_DTYPES: dict[str, type[np.generic]] = {
    "tensor(float)": np.float32,
    "tensor(double)": np.float64,
    "tensor(float16)": np.float16,
    "tensor(int64)": np.int64,
    "tensor(int32)": np.int32,
    "tensor(int16)": np.int16,
    "tensor(int8)": np.int8,
    "tensor(uint8)": np.uint8,
    "tensor(bool)": np.bool_,
}


@dataclass
class BaselinePoint:
    batch: int
    runs: int
    p50_ms: float
    mean_ms: float
    items_per_s: float


@dataclass
class PacedPoint:
    """The engine at a fixed rate of batch-1 runs, evenly spaced: what one run costs in CPU
    (every thread of this process) when the engine sleeps between runs, as a served model
    does at that rate."""

    rate: float
    runs: int
    cpu_us_per_run: float
    p50_ms: float


@dataclass
class Baseline:
    model_path: str
    threads: int
    max_batch_size: int
    points: list[BaselinePoint]
    engine: str = "onnxruntime"
    paced: list[PacedPoint] = field(default_factory=list)
    """The engine's own CPU per run at the rates the stack was loaded at (``--rate``)."""

    @property
    def best(self) -> BaselinePoint:
        return max(self.points, key=lambda point: point.items_per_s)

    @property
    def batch1_p50_ms(self) -> float:
        return self.points[0].p50_ms


def latest_model_file(repository: Path, model: str) -> Path:
    """``<repository>/<model>/<highest numeric version>/model.onnx``."""
    versions = [
        entry
        for entry in (repository / model).glob("*")
        if entry.name.isdigit() and (entry / "model.onnx").is_file()
    ]
    if not versions:
        raise FileNotFoundError(f"no <version>/model.onnx under {repository / model}")
    return max(versions, key=lambda entry: int(entry.name)) / "model.onnx"


def config_max_batch_size(repository: Path, model: str) -> int:
    """``max_batch_size`` from the model's config.pbtxt (0 when absent, as in Triton)."""
    text = (repository / model / "config.pbtxt").read_text()
    match = re.search(r"^\s*max_batch_size\s*:\s*(\d+)", text, re.MULTILINE)
    return int(match.group(1)) if match else 0


def batch_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4, ... up to ``max_batch_size`` (which is included); [1] for unbatched models."""
    sizes, size = [], 1
    while size <= max(max_batch_size, 1):
        sizes.append(size)
        size *= 2
    if max_batch_size > sizes[-1]:
        sizes.append(max_batch_size)
    return sizes


def make_session(model_path: Path, threads: int, spinning: bool = True) -> ort.InferenceSession:
    """A CPU session with the worker's thread settings; ``spinning``: the intra-op threads
    spin between runs (onnxruntime's default: the fastest back to back; the worker turns it
    off, as a sleeping thread costs no CPU between sparse runs)."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    if not spinning:
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(str(model_path), options, providers=["CPUExecutionProvider"])


def random_feed(
    session: ort.InferenceSession, batch: int, batched: bool, rng: np.random.Generator
) -> dict[str, np.ndarray]:
    feed: dict[str, np.ndarray] = {}
    for node in session.get_inputs():
        dims = [dim if isinstance(dim, int) and dim > 0 else 1 for dim in node.shape]
        if batched:
            dims[0] = batch
        dtype = _ORT_DTYPES.get(node.type)
        if dtype is None:
            raise ValueError(f"input {node.name!r}: type {node.type} is not supported")
        feed[node.name] = rng.standard_normal(dims).astype(dtype)
    return feed


def time_batch(
    session: ort.InferenceSession, feed: dict[str, np.ndarray], batch: int, seconds: float
) -> BaselinePoint:
    """Run ``feed`` repeatedly for about ``seconds`` (at least MIN_RUNS times)."""
    return time_runs(lambda: session.run(None, feed), batch, seconds)


def time_runs(once: Callable[[], object], batch: int, seconds: float) -> BaselinePoint:
    """``once()`` (a batch of ``batch`` items) after WARMUP_RUNS, repeatedly for about
    ``seconds`` and at least MIN_RUNS times."""
    for _ in range(WARMUP_RUNS):
        once()
    times: list[float] = []
    started = perf_counter()
    while len(times) < MIN_RUNS or perf_counter() - started < seconds:
        before = perf_counter()
        once()
        times.append(perf_counter() - before)
    total = sum(times)
    return BaselinePoint(
        batch=batch,
        runs=len(times),
        p50_ms=float(np.median(times)) * 1000.0,
        mean_ms=total / len(times) * 1000.0,
        items_per_s=batch * len(times) / total,
    )


def run_paced(
    model_path: Path, batched: bool, threads: int, rate: float, seconds: float
) -> PacedPoint:
    """Batch-1 runs at ``rate`` per second, evenly spaced, for about ``seconds``, with the
    worker's settings (intra-op threads that do not spin)."""
    session = make_session(model_path, threads, spinning=False)
    feed = random_feed(session, 1, batched, np.random.default_rng(0))
    for _ in range(WARMUP_RUNS):
        session.run(None, feed)
    interval = 1.0 / rate
    runs = max(MIN_RUNS, round(rate * seconds))
    times: list[float] = []
    cpu_before, due = process_time(), perf_counter()
    for _ in range(runs):
        due += interval
        delay = due - perf_counter()
        if delay > 0:
            sleep(delay)
        before = perf_counter()
        session.run(None, feed)
        times.append(perf_counter() - before)
    cpu = process_time() - cpu_before
    return PacedPoint(rate, runs, cpu / runs * 1e6, float(np.median(times)) * 1000.0)


def run_baseline(
    model_path: Path, max_batch_size: int, threads: int = 1, seconds_per_batch: float = 0.5
) -> Baseline:
    """Time the model in-process at batch 1, 2, 4, ... ``max_batch_size``."""
    session = make_session(model_path, threads)
    rng = np.random.default_rng(0)
    points = []
    for batch in batch_sizes(max_batch_size):
        feed = random_feed(session, batch, max_batch_size > 0, rng)
        points.append(time_batch(session, feed, batch, seconds_per_batch))
    return Baseline(str(model_path), threads, max_batch_size, points)


def run_best_baseline(
    model_path: Path, max_batch_size: int, seconds_per_batch: float = 0.5
) -> Baseline:
    """The engine at its best on this machine: :func:`run_baseline` with 1, 2, ... every
    usable core, the run with the highest throughput."""
    runs = [
        run_baseline(model_path, max_batch_size, threads, seconds_per_batch)
        for threads in range(1, usable_cores() + 1)
    ]
    return max(runs, key=lambda run: run.best.items_per_s)
