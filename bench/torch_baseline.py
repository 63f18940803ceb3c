"""In-process PyTorch baseline for TorchScript models (``model.pt``), on the device the
model's config asks for: the GPU for ``KIND_GPU``, else the CPU at its best thread count.

Each timed run starts from host memory and ends in host memory (inputs copied to the
device, outputs copied back), as a served request must, so the comparison is fair to both.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np

from bench.baseline import Baseline, BaselinePoint, batch_sizes, time_runs
from sluice.core.runtime import usable_cores

_NUMPY_DTYPES = {"FP32": np.float32, "FP16": np.float16, "FP64": np.float64, "INT64": np.int64}


def torchscript_file(repository: Path, model: str) -> Path | None:
    """``<model>/<highest version>/model.pt``, or None when the model has none."""
    versions = [
        entry
        for entry in (repository / model).glob("*")
        if entry.name.isdigit() and (entry / "model.pt").is_file()
    ]
    return max(versions, key=lambda entry: int(entry.name)) / "model.pt" if versions else None


def wants_gpu(repository: Path, model: str) -> bool:
    text = (repository / model / "config.pbtxt").read_text()
    return re.search(r"kind\s*:\s*KIND_GPU", text) is not None


def _feed(
    metadata: dict[str, Any], batch: int, batched: bool, rng: np.random.Generator
) -> list[np.ndarray]:
    feed = []
    for tensor in metadata["inputs"]:
        dims = [dim if dim > 0 else 1 for dim in tensor["shape"]]
        if batched:
            dims[0] = batch
        dtype = _NUMPY_DTYPES.get(tensor["datatype"])
        if dtype is None:
            raise ValueError(f"input {tensor['name']!r}: {tensor['datatype']} is not supported")
        feed.append(rng.standard_normal(dims).astype(dtype))
    return feed


def _time(
    module: Any, feed: list[np.ndarray], device: Any, batch: int, seconds: float
) -> BaselinePoint:
    import torch

    def once() -> None:
        with torch.inference_mode():
            outputs = module(*(torch.from_numpy(array).to(device) for array in feed))
            for output in outputs if isinstance(outputs, tuple | list) else (outputs,):
                output.cpu().numpy()  # waits for the device

    return time_runs(once, batch, seconds)


def run_torch_baseline(
    path: Path, metadata: dict[str, Any], max_batch_size: int, gpu: bool, seconds: float
) -> Baseline:
    """The model at batch 1, 2, 4, ... ``max_batch_size``: on GPU 0 when ``gpu``, else on the
    CPU with the best of 1 .. every usable core's threads."""
    import torch

    device = torch.device("cuda", 0) if gpu else torch.device("cpu")
    module = torch.jit.load(str(path), map_location=device).eval()
    rng = np.random.default_rng(0)
    thread_counts = [torch.get_num_threads()] if gpu else range(1, usable_cores() + 1)
    runs = []
    for threads in thread_counts:
        torch.set_num_threads(threads)
        points = [
            _time(module, _feed(metadata, batch, max_batch_size > 0, rng), device, batch, seconds)
            for batch in batch_sizes(max_batch_size)
        ]
        runs.append(Baseline(f"{path} on {device}", threads, max_batch_size, points, "torch"))
    return max(runs, key=lambda run: run.best.items_per_s)
