"""Where each model instance runs, from its instance groups and the GPUs this host has.

One concept for both sides: the executor decides placements (``sluice up``), the worker
runs its backend on the one it was given."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from dataclasses import dataclass

from sluice.core.config import InstanceGroup
from sluice.core.runtime import usable_cores


@dataclass(frozen=True, slots=True)
class Placement:
    """Where one model instance runs."""

    kind: str = "KIND_CPU"
    """"KIND_CPU" or "KIND_GPU"."""
    gpu: int | None = None
    threads: int = 1
    """Compute threads this instance may use."""


@functools.cache
def visible_gpus() -> tuple[int, ...]:
    """Indices of the NVIDIA GPUs this process may use (none where there is no driver)."""
    restricted = os.environ.get("CUDA_VISIBLE_DEVICES")
    if restricted is not None:
        return tuple(range(len([d for d in restricted.split(",") if d.strip()])))
    nvidia_smi = shutil.which("nvidia-smi")
    if nvidia_smi is None:
        return ()
    try:
        listing = subprocess.run([nvidia_smi, "-L"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return ()
    return tuple(range(sum(1 for line in listing.stdout.splitlines() if line.startswith("GPU "))))


def placements(groups: tuple[InstanceGroup, ...], gpus: tuple[int, ...]) -> list[Placement]:
    """Triton's rules: ``count`` instances on each listed GPU (every visible GPU when none is
    listed); KIND_AUTO means GPU when the host has one; no group means one CPU instance. A
    KIND_GPU group on a host without GPUs still gets placements, so its workers report why
    they cannot load."""
    if not groups:
        return [Placement()]
    result: list[Placement] = []
    for group in groups:
        on_gpu = group.kind == "KIND_GPU" or (group.kind == "KIND_AUTO" and bool(gpus))
        if not on_gpu:
            result.extend([Placement()] * group.count)
            continue
        for device in group.gpus or gpus or (0,):
            result.extend([Placement("KIND_GPU", device)] * group.count)
    return result


def threads_per_instance(instances: int) -> int:
    """Compute threads of each of a model version's ``instances`` workers: every core this
    process may use, divided among that model's own instances only. The workers of other
    models take none: an idle model uses no core, and the busy one gets the machine (a
    worker's thread pool does not spin while it waits, see the onnxruntime backend)."""
    return max(1, usable_cores() // max(1, instances))
