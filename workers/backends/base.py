"""What every backend offers a worker."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from sluice.config import ModelConfig


@dataclass(frozen=True, slots=True)
class Placement:
    """Where one model instance runs."""

    kind: str = "KIND_CPU"
    """"KIND_CPU" or "KIND_GPU"."""
    gpu: int | None = None
    threads: int = 1
    """Compute threads this instance may use."""


class Backend(Protocol):
    def infer(
        self, inputs: Mapping[str, np.ndarray], outputs: Sequence[str]
    ) -> dict[str, np.ndarray]:
        """Run one batch of named arrays; return the named outputs asked for."""
        ...

    def close(self) -> None: ...


class BackendFactory(Protocol):
    def __call__(self, config: ModelConfig, model_path: Path, placement: Placement) -> Backend: ...
