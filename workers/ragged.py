"""Ragged batching in the worker: what the model receives for a batch whose requests'
ragged inputs differ in shape, the batch inputs made for it, and each request's part of
an output scattered back by its input's shape (the configuration's side, and Triton's
semantics: :mod:`sluice.core.config.ragged`).

A Python model takes each request of such a batch with its own shape instead
(:class:`RaggedInputs`), and may answer each with outputs of its own shape
(:class:`RaggedOutputs`)."""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence

import numpy as np

from sluice.core.config import ModelConfig
from sluice.core.config.ragged import BatchInput
from sluice.core.datatypes import numpy_dtype
from sluice.core.errors import InferenceFailed, InvalidInput
from sluice.workers.backends.base import PartialOutputs

Shape = tuple[int, ...]


class RaggedInputs(dict[str, np.ndarray]):
    """A Python model's batch whose ragged inputs differ in shape between its requests:
    the other inputs joined along the batch dimension, as usual, and ``parts[name]``: each
    request's own array of ragged input ``name``, in order (no one tensor can hold them)."""

    def __init__(
        self, arrays: Mapping[str, np.ndarray], parts: Mapping[str, Sequence[np.ndarray]]
    ) -> None:
        super().__init__(arrays)
        self.parts = {name: list(own) for name, own in parts.items()}


class RaggedOutputs(PartialOutputs):
    """Whole-batch outputs of which some differ in shape between the batch's requests (a
    Python model answers each request on its own): ``parts[name]`` is each request's own
    array of output ``name``, in order; the dict holds their elements one after the other,
    in one dimension. ``absent``: as :class:`PartialOutputs`."""

    def __init__(
        self,
        arrays: Mapping[str, np.ndarray],
        absent: Mapping[int, frozenset[str]],
        parts: Mapping[str, Sequence[np.ndarray]],
    ) -> None:
        super().__init__(arrays, absent)
        self.parts = {name: list(own) for name, own in parts.items()}


def own_outputs(outputs: Mapping[str, np.ndarray]) -> dict[str, list[np.ndarray]]:
    """Each request's own array of the outputs whose shapes differ (:class:`RaggedOutputs`)."""
    return outputs.parts if isinstance(outputs, RaggedOutputs) else {}


def batch_items(inputs: Mapping[str, np.ndarray]) -> int | None:
    """The batch dimension of a batch's inputs (a :class:`RaggedInputs` too); None when
    there are none."""
    for array in inputs.values():
        return int(array.shape[0])
    parts = inputs.parts if isinstance(inputs, RaggedInputs) else {}
    for own in parts.values():
        return sum(int(array.shape[0]) for array in own)
    return None


def request_inputs(
    inputs: Mapping[str, np.ndarray], sizes: Sequence[int], batched: bool
) -> list[dict[str, np.ndarray]]:
    """Each request's inputs: its rows of the joined inputs (the whole of them for a model
    that does not batch) and its own array of each ragged one (:class:`RaggedInputs`)."""
    parts = inputs.parts if isinstance(inputs, RaggedInputs) else {}
    requests: list[dict[str, np.ndarray]] = []
    start = 0
    for index, items in enumerate(sizes):
        own = {
            name: array[start : start + items] if batched else array
            for name, array in inputs.items()
        }
        own.update((name, arrays[index]) for name, arrays in parts.items())
        requests.append(own)
        start += items
    return requests


def differ(parts: Sequence[np.ndarray]) -> bool:
    """Whether the requests' arrays of one tensor differ in shape past the batch dimension
    (they cannot be joined along it)."""
    return len({part.shape[1:] for part in parts}) > 1


def alike(requests: Sequence[Mapping[str, np.ndarray]]) -> list[list[int]]:
    """The requests' indices grouped by their inputs' shapes past the batch dimension (in
    order of first appearance): the requests of a group can be joined into one batch."""
    groups: dict[tuple[tuple[str, Shape], ...], list[int]] = {}
    for index, request in enumerate(requests):
        key = tuple(sorted((name, array.shape[1:]) for name, array in request.items()))
        groups.setdefault(key, []).append(index)
    return list(groups.values())


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
