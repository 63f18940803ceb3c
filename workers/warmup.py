"""Warm-up from the configuration's ``model_warmup`` before a worker takes traffic."""

from __future__ import annotations

from pathlib import Path

from sluice.config import ModelConfig
from workers.backends.base import Backend


def warm_up(backend: Backend, config: ModelConfig, model_dir: Path) -> None:
    """Run every warm-up sample; raise a SluiceError naming the sample when one fails."""
    return None
