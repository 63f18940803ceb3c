"""Known platforms/backends and the model file each one loads by default."""

from __future__ import annotations

ONNX_PLATFORM = "onnxruntime_onnx"
ONNX_BACKEND = "onnxruntime"
ONNX_FILENAME = "model.onnx"

_FILENAME_BY_PLATFORM: dict[str, str] = {
    ONNX_PLATFORM: ONNX_FILENAME,
    "pytorch_libtorch": "model.pt",
    "tensorrt_plan": "model.plan",
    "tensorflow_savedmodel": "model.savedmodel",
    "tensorflow_graphdef": "model.graphdef",
    "torch_aoti": "model.pt2",
}

_FILENAME_BY_BACKEND: dict[str, str] = {
    ONNX_BACKEND: ONNX_FILENAME,
    "pytorch": "model.pt",
    "tensorrt": "model.plan",
    "python": "model.py",
    "torch_aoti": "model.pt2",
    "openvino": "model.xml",
    "torchserve": "model.mar",
    "tensorflow": "model.savedmodel",
}

TREE_BACKEND = "fil"
"""Triton's FIL backend: tree models; the file depends on ``parameters.model_type``."""
_FILENAME_BY_TREE_FORMAT: dict[str, str] = {
    "xgboost_ubj": "xgboost.ubj",
    "xgboost_json": "xgboost.json",
    "xgboost": "xgboost.model",
    "lightgbm": "model.txt",
    "treelite_checkpoint": "checkpoint.tl",
}

# Model files from which the platform is inferred when the config names none (Triton does
# this for the first three; a torch.export package and a model.py are unambiguous too).
PLATFORM_BY_FILE_SUFFIX: dict[str, tuple[str, str]] = {
    ".onnx": (ONNX_PLATFORM, ONNX_BACKEND),
    ".plan": ("tensorrt_plan", "tensorrt"),
    ".pt": ("pytorch_libtorch", "pytorch"),
    ".pt2": ("pytorch_libtorch", "pytorch"),
    ".py": ("", "python"),
}

TORCH_PLATFORMS = frozenset({"pytorch_libtorch", "torch_aoti"})
TORCH_BACKENDS = frozenset({"pytorch", "torch_aoti"})
TORCH_EXPORT_FILENAME = "model.pt2"


def default_model_filename(platform: str, backend: str, model_type: str = "") -> str:
    """The file Triton loads when ``default_model_filename`` is not set ("" if unknown);
    ``model_type``: the FIL backend's parameter of that name."""
    if backend == TREE_BACKEND:
        return _FILENAME_BY_TREE_FORMAT.get(model_type, "")
    return _FILENAME_BY_PLATFORM.get(platform) or _FILENAME_BY_BACKEND.get(backend, "")


def tree_formats() -> tuple[str, ...]:
    """The FIL backend's ``model_type`` values."""
    return tuple(_FILENAME_BY_TREE_FORMAT)


def is_onnx(platform: str, backend: str) -> bool:
    return platform == ONNX_PLATFORM or backend == ONNX_BACKEND


def is_torch(platform: str, backend: str) -> bool:
    return platform in TORCH_PLATFORMS or backend in TORCH_BACKENDS


def fallback_model_filename(platform: str, backend: str, filename: str) -> str | None:
    """Another file to load when ``filename`` is absent: a torch.export ``model.pt2``
    stands in for the PyTorch backend's default ``model.pt``."""
    if is_torch(platform, backend) and filename == "model.pt":
        return TORCH_EXPORT_FILENAME
    return None
