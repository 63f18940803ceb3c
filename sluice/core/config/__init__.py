"""Triton model configuration: parsing, validation, autocomplete and JSON rendering."""

from ._schema import model_config_pb2, new_model_config
from .autocomplete import autocomplete_from_onnx
from .ensemble import LATEST, CycleError, ensemble_problem, step_levels
from .model import (
    ENSEMBLE_PLATFORM,
    DynamicBatching,
    EnsembleStep,
    FrozenMap,
    InstanceGroup,
    ModelConfig,
    RateLimiter,
    RateLimiterResource,
    TensorSpec,
    VersionPolicy,
    WarmupInput,
    WarmupSample,
)
from .parse import (
    CONFIG_FILENAME,
    config_from_json,
    config_from_proto,
    config_to_json,
    config_to_proto,
    parse_config_text,
)
from .platforms import (
    ONNX_BACKEND,
    ONNX_FILENAME,
    ONNX_PLATFORM,
    PLATFORM_BY_FILE_SUFFIX,
    default_model_filename,
    is_onnx,
)
from .render import render_config
from .sequence import SequenceBatching, SequenceControl, SequenceState

__all__ = [
    "CONFIG_FILENAME",
    "ENSEMBLE_PLATFORM",
    "LATEST",
    "ONNX_BACKEND",
    "ONNX_FILENAME",
    "ONNX_PLATFORM",
    "PLATFORM_BY_FILE_SUFFIX",
    "CycleError",
    "DynamicBatching",
    "EnsembleStep",
    "FrozenMap",
    "InstanceGroup",
    "ModelConfig",
    "RateLimiter",
    "RateLimiterResource",
    "SequenceBatching",
    "SequenceControl",
    "SequenceState",
    "TensorSpec",
    "VersionPolicy",
    "WarmupInput",
    "WarmupSample",
    "autocomplete_from_onnx",
    "config_from_json",
    "config_from_proto",
    "config_to_json",
    "config_to_proto",
    "default_model_filename",
    "ensemble_problem",
    "is_onnx",
    "model_config_pb2",
    "new_model_config",
    "parse_config_text",
    "render_config",
    "step_levels",
]
