"""Deterministic sample tensors of every fixed-width datatype, edge values included."""

from __future__ import annotations

from typing import Any

import numpy as np

from sluice.core.config import parse_config_text

TINY_CONFIG = parse_config_text(
    """
    name: "m"
    platform: "onnxruntime_onnx"
    max_batch_size: 8
    input [ { name: "x" data_type: TYPE_FP32 dims: [ -1 ] } ]
    output [ { name: "y" data_type: TYPE_FP32 dims: [ -1 ] } ]
    """,
    model_name="m",
)
"""A model config with one FP32 input ``x`` and one output ``y``, for tests of the parts
around a model (no model file behind it)."""

FIXED_TYPES = [
    ("BOOL", np.bool_),
    ("UINT8", np.uint8),
    ("UINT16", np.uint16),
    ("UINT32", np.uint32),
    ("UINT64", np.uint64),
    ("INT8", np.int8),
    ("INT16", np.int16),
    ("INT32", np.int32),
    ("INT64", np.int64),
    ("FP16", np.float16),
    ("FP32", np.float32),
    ("FP64", np.float64),
]


def sample(dtype: Any, shape: tuple[int, ...]) -> np.ndarray:
    """Integers include each type's min and max; floats include negatives and fractions."""
    count = int(np.prod(shape))
    if dtype is np.bool_:
        return (np.arange(count) % 3 == 0).reshape(shape)
    if np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)
        values = [info.min, info.max, 0, 1, info.max - 1, info.min + 1] * count
        return np.array(values[:count], dtype=dtype).reshape(shape)
    return (np.arange(count, dtype=np.float64) * 0.25 - 1.5).astype(dtype).reshape(shape)
