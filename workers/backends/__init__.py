"""Backend selection by the configuration's platform / backend fields."""

from __future__ import annotations

from pathlib import Path

from sluice.config import ModelConfig
from sluice.errors import Unsupported
from workers.backends.base import Backend, Placement

_ONNX = {"onnxruntime_onnx", "onnxruntime"}


def load_backend(config: ModelConfig, model_path: Path, placement: Placement) -> Backend:
    if config.platform in _ONNX or config.backend in _ONNX:
        from workers.backends.onnxruntime_backend import OnnxRuntimeBackend

        return OnnxRuntimeBackend(config, model_path, placement)
    raise Unsupported(
        f"model '{config.name}': platform '{config.platform}' / backend '{config.backend}' "
        "is not supported yet (supported: onnxruntime_onnx)"
    )
