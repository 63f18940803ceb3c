"""Backend selection by the configuration's platform / backend fields.

Each backend is imported only when a model needs it, so a worker of an ONNX
model never imports torch, and a machine without TensorRT serves everything else.
"""

from __future__ import annotations

from pathlib import Path

from sluice.core.config import ModelConfig
from sluice.core.config.platforms import TREE_BACKEND, is_torch
from sluice.core.errors import InvalidConfig, Unsupported
from sluice.core.placement import Placement
from sluice.core.settings import DEFAULT_MAX_BATCH_SIZE
from sluice.workers.backends.base import Backend

_ONNX = {"onnxruntime_onnx", "onnxruntime"}
_TENSORRT = {"tensorrt_plan", "tensorrt"}
_TENSORFLOW = {"tensorflow_savedmodel", "tensorflow_graphdef"}
_SUPPORTED = (
    "onnxruntime_onnx, pytorch_libtorch / pytorch, torch_aoti, tensorrt_plan / tensorrt, "
    "python, fil (tree models), openvino, torchserve (.mar archives), "
    "tensorflow_savedmodel, tensorflow_graphdef, ensemble"
)


def load_backend(
    config: ModelConfig,
    model_path: Path,
    placement: Placement,
    config_name: str = "",
    *,
    default_max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
) -> Backend:
    """The backend of ``config``; ``config_name``: the deployment's custom configuration
    name (an ensemble reads its composing models' configurations with it)."""
    if config.platform in _ONNX or config.backend in _ONNX:
        from sluice.workers.backends.onnxruntime_backend import OnnxRuntimeBackend

        return OnnxRuntimeBackend(config, model_path, placement)
    if is_torch(config.platform, config.backend):
        try:
            from sluice.workers.backends.torch_backend import TorchBackend
        except ImportError as exc:
            raise InvalidConfig(
                f"model '{config.name}' needs PyTorch, which cannot be imported ({exc}); "
                "install sluice[torch]"
            ) from None
        return TorchBackend(config, model_path, placement)
    if config.platform in _TENSORRT or config.backend in _TENSORRT:
        from sluice.workers.backends.tensorrt_backend import TensorRTBackend

        return TensorRTBackend(config, model_path, placement)
    if config.backend == TREE_BACKEND:
        from sluice.workers.backends.tree_backend import TreeBackend

        return TreeBackend(config, model_path, placement)
    if config.platform in _TENSORFLOW or config.backend == "tensorflow":
        from sluice.workers.backends.tensorflow_backend import TensorFlowBackend

        return TensorFlowBackend(config, model_path, placement)
    if config.backend == "torchserve":
        from sluice.workers.backends.torchserve_backend import TorchServeBackend

        return TorchServeBackend(config, model_path, placement)
    if config.backend == "openvino":
        from sluice.workers.backends.openvino_backend import OpenVinoBackend

        return OpenVinoBackend(config, model_path, placement)
    if config.is_ensemble:
        from sluice.workers.backends.ensemble_backend import load_ensemble_backend

        return load_ensemble_backend(
            config, model_path, placement, config_name, default_max_batch_size
        )
    if config.backend == "python":
        from sluice.workers.backends.python_backend import load_python_backend

        return load_python_backend(config, model_path, placement)
    raise Unsupported(
        f"model '{config.name}': platform '{config.platform}' / backend '{config.backend}' "
        f"is not supported (supported: {_SUPPORTED})"
    )
