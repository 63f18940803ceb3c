"""Ragged batching in the worker: what the model receives for a batch whose requests'
ragged inputs differ in shape, the batch inputs made for it, and each request's part of
an output scattered back by its input's shape (the configuration's side, and Triton's
semantics: :mod:`sluice.core.config.ragged`)."""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence

import numpy as np

from sluice.core.config import ModelConfig
from sluice.core.config.ragged import BatchInput
from sluice.core.datatypes import numpy_dtype
from sluice.core.errors import InferenceFailed, InvalidInput

Shape = tuple[int, ...]


def concatenated(parts: Sequence[np.ndarray]) -> np.ndarray:
    """A ragged input of the batch: the requests' elements in order, in one dimension."""
    if len(parts) == 1:
        return parts[0].reshape(-1)
    return np.concatenate([part.reshape(-1) for part in parts])


def batch_input(spec: BatchInput, shapes: Sequence[Shape | None]) -> np.ndarray:
    """The tensor ``spec`` makes for a batch whose requests' source inputs have ``shapes``
    (whole request tensors, batch dimension first; None where a request lacks it)."""
    dtype = numpy_dtype(spec.datatype)
    counts = [math.prod(shape) if shape is not None else 0 for shape in shapes]
    kind = spec.kind
    if kind == "BATCH_ELEMENT_COUNT":
        return _typed(np.asarray(counts, dtype=np.int64), spec)
    if kind == "BATCH_ACCUMULATED_ELEMENT_COUNT":
        return _typed(np.cumsum(counts, dtype=np.int64), spec)
    if kind == "BATCH_ACCUMULATED_ELEMENT_COUNT_WITH_ZERO":
        return _typed(np.cumsum([0, *counts], dtype=np.int64), spec)
    if kind == "BATCH_MAX_ELEMENT_COUNT_AS_SHAPE":
        return np.zeros(max(counts, default=0), dtype=dtype)
    rank = max((len(shape) - 1 for shape in shapes if shape is not None), default=0)
    items = [
        shape[1:] if shape is not None else (0,) * rank
        for shape in shapes
        for _ in range(shape[0] if shape else 1)
    ]
    array = _typed(np.asarray(items, dtype=np.int64).reshape(len(items), rank), spec)
    return array.reshape(-1) if kind == "BATCH_ITEM_SHAPE_FLATTEN" else array


def _typed(values: np.ndarray, spec: BatchInput) -> np.ndarray:
    """``values`` in the batch input's datatype. A value an integer type cannot hold (a
    client's empty tensor may have a dimension past 2**31) is refused, not wrapped into a
    wrong size: as :class:`InvalidInput`, on which the worker runs the batch's requests
    one by one, so that only the request whose shape it is fails."""
    dtype = numpy_dtype(spec.datatype)
    if dtype.kind == "i" and values.size and int(values.max()) > np.iinfo(dtype).max:
        raise InvalidInput(
            f"input '{spec.source}': its shape gives batch input '{spec.target}' the value "
            f"{int(values.max())}, more than {spec.datatype} holds"
        )
    return values.astype(dtype)


def scattered(
    name: str, array: np.ndarray, dims: Shape, source: str, shapes: Sequence[Shape | None]
) -> list[np.ndarray]:
    """Each request's part of output ``name`` (config ``dims``) scattered by the shapes of
    input ``source``: the output's variable dimensions (the batch one first) take the
    source's sizes, in order. The sizes are checked against the output before any part is
    cut: a model that returns the wrong size fails the batch, naming both sizes."""
    flat = array.reshape(-1)
    wanted = [_part_shape(name, dims, source, shape) for shape in shapes]
    counts = [math.prod(shape) for shape in wanted]
    if sum(counts) != flat.size:
        raise InferenceFailed(
            f"output '{name}' has {flat.size} elements; scattering it by input '{source}' "
            f"needs {sum(counts)}"
        )
    parts: list[np.ndarray] = []
    start = 0
    for shape, count in zip(wanted, counts, strict=True):
        parts.append(flat[start : start + count].reshape(shape))
        start += count
    return parts


def _part_shape(name: str, dims: Shape, source: str, shape: Shape | None) -> Shape:
    wanted = _scatter_shape((-1, *dims), shape or ())
    if wanted is None:
        raise InferenceFailed(
            f"output '{name}' cannot be scattered by input '{source}': the input has "
            f"fewer dimensions than the output's variable ones"
        )
    return wanted


def _scatter_shape(dims: Shape, source: Shape) -> Shape | None:
    shape: list[int] = []
    for index, dim in enumerate(dims):
        if dim != -1:
            shape.append(dim)
        elif index < len(source):
            shape.append(source[index])
        else:
            return None
    return tuple(shape)


def missing_source(config: ModelConfig, names: Collection[str]) -> str | None:
    """The first input that the model's batch inputs and outputs are made from and that a
    request with inputs ``names`` lacks (an optional one), if any: Triton fails such a
    request, where its counts would be zeros and its parts shapeless."""
    sources = [made.source for made in config.batch_inputs]
    sources += [entry.source for entry in config.batch_outputs]
    return next((name for name in sources if name not in names), None)


def scatter_sources(config: ModelConfig) -> dict[str, str]:
    """Output name -> the input whose shapes scatter it."""
    return {target: entry.source for entry in config.batch_outputs for target in entry.targets}
