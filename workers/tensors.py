"""Combining requests into one batch and splitting the outputs back.

Requests are combined along the batch dimension (dim 0) only when every input
has the same per-item shape, but for ragged inputs (:mod:`sluice.workers.ragged`: their
elements concatenated, or each request's own array for a Python model);
:func:`shape_key` says which requests can share a batch. Everything here is pure
computation, run off the event loop.

Tensors passed by shared memory reference are read where they are (a client's region
or a gateway's segment, see :mod:`sluice.workers.shm_io`); outputs the client wants in its
region are written there, and large outputs go into a segment of their own when the
request allows it, so neither crosses Redis.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from sluice.core.classification import CLASSIFIABLE, classify, unsupported_message
from sluice.core.config import ModelConfig, TensorSpec
from sluice.core.config.ragged import keeps_request_shapes
from sluice.core.datatypes import BYTES, count_bytes_elements, numpy_dtype, to_buffer, to_numpy
from sluice.core.errors import InferenceFailed, InvalidInput, Unavailable
from sluice.core.shm import new_segment_name, unlink, write_segment
from sluice.core.wire import RequestMessage, ShmRef, TensorHeader
from sluice.workers import ragged, shm_io

ShapeKey = tuple[tuple[str, tuple[int, ...]], ...]


@dataclass(slots=True)
class PendingRequest:
    entry_id: bytes
    message: RequestMessage
    payload: memoryview
    items: int
    """Batch items this request carries (its dim 0; 1 for non-batching models)."""
    key: ShapeKey
    stream: str = ""
    """The stream the entry came from (one per priority level)."""
    level: int = 0
    """Index of that stream in priority order (0 = served first)."""
    deliveries: int = 1


def request_items(message: RequestMessage, config: ModelConfig) -> int:
    if config.max_batch_size == 0 or not message.inputs:
        return 1
    return message.inputs[0].shape[0] if message.inputs[0].shape else 1


def shape_key(message: RequestMessage, config: ModelConfig) -> ShapeKey:
    """Requests with equal keys can be concatenated; non-batching models never share."""
    if config.max_batch_size == 0:
        return ((message.request_key, ()),)
    ragged_inputs = config.ragged_inputs  # (any shapes: concatenated, or kept per request)
    if ragged_inputs:
        return tuple(
            sorted((t.name, () if t.name in ragged_inputs else t.shape[1:]) for t in message.inputs)
        )
    return tuple(sorted((t.name, t.shape[1:]) for t in message.inputs))


def validate(message: RequestMessage, config: ModelConfig) -> None:
    """Re-check what the gateway checked: a stream entry is outside input too, and the
    requests of an ensemble's steps (or of a Python model's calls) reach the stream without
    a gateway: a step's shape comes from what the model before it made."""
    first = 1 if config.max_batch_size > 0 else 0  # the model's dims start after the batch's
    for tensor in message.inputs:
        spec = config.input(tensor.name)
        if spec is None:
            raise InvalidInput(f"unknown input '{tensor.name}'")
        if spec.datatype != tensor.datatype:
            raise InvalidInput(f"input '{tensor.name}': expected datatype {spec.datatype}")
        shape = tensor.shape
        if len(shape) != len(spec.dims) + first or any(
            want not in (-1, got) for want, got in zip(spec.dims, shape[first:], strict=False)
        ):
            expected = (-1, *spec.dims) if first else spec.dims
            raise InvalidInput(
                f"[request id: {message.client_id or '<id_unknown>'}] unexpected shape for "
                f"input '{tensor.name}' for model '{config.name}'. Expected "
                f"{_shown(expected)}, got {_shown(shape)}"
            )
    for name in message.outputs:
        if config.output(name) is None:
            raise InvalidInput(f"unknown output '{name}'")
    if config.batch_inputs or config.batch_outputs:
        missing = ragged.missing_source(config, {t.name for t in message.inputs})
        if missing is not None:
            raise InvalidInput(
                f"input '{missing}' is required: the model's batch inputs and outputs are "
                "made from its shape"
            )
    if shm_io.MAPPINGS.elsewhere(message.host):
        if message.output_regions or any(t.shm is not None for t in message.inputs):
            raise Unavailable(
                f"the request's tensors are in shared memory on host '{message.host}' and "
                f"it reached a worker on host '{shm_io.MAPPINGS.host}'; retry"
            )
        message.segment_prefix, message.segment_min_bytes = "", 0  # outputs come inline
    for tensor in message.inputs:
        if tensor.shm is not None:
            shm_io.MAPPINGS.check(tensor.shm, f"input '{tensor.name}'")
    for name, ref in message.output_regions.items():
        if name not in message.outputs:
            raise InvalidInput(f"output '{name}' has a shared memory region but is not requested")
        shm_io.MAPPINGS.check(ref, f"output '{name}'")
    for name in message.classes:
        spec = config.output(name)
        if spec is None or name not in message.outputs or name in message.output_regions:
            raise InvalidInput(f"output '{name}': classification of an output not requested")
        if spec.datatype not in CLASSIFIABLE:
            raise InvalidInput(unsupported_message(spec.datatype))


def _shown(shape: Sequence[int]) -> str:
    return "[" + ",".join(map(str, shape)) + "]"


def _model_shape(
    spec: TensorSpec, leading: tuple[int, ...], shape: tuple[int, ...]
) -> tuple[int, ...]:
    if spec.reshape is None:
        return shape
    return leading + spec.reshape


def combine(requests: Sequence[PendingRequest], config: ModelConfig) -> dict[str, np.ndarray]:
    """Named arrays for the whole batch, reshaped as the model expects. A Python model's
    ragged input whose shapes differ stays each request's own (:class:`ragged.RaggedInputs`)."""
    per_input: dict[str, list[np.ndarray]] = {}
    for request in requests:
        offset = 0
        for tensor in request.message.inputs:
            if tensor.shm is None:
                data = request.payload[offset : offset + tensor.nbytes]
                offset += tensor.nbytes
            else:
                what = f"input '{tensor.name}'"
                data = shm_io.input_view(tensor.shm, request.message.segment_prefix, what)
            per_input.setdefault(tensor.name, []).append(_input_array(tensor, data))
    batched = config.max_batch_size > 0
    total = sum(r.items for r in requests)
    per_request = keeps_request_shapes(config.backend)
    arrays: dict[str, np.ndarray] = {}
    own: dict[str, list[np.ndarray]] = {}
    for name, parts in per_input.items():
        spec = config.input(name)
        assert spec is not None
        if name in config.ragged_inputs and not per_request:
            arrays[name] = ragged.concatenated(parts)
            continue
        if name in config.ragged_inputs and ragged.differ(parts):
            own[name] = [p.reshape(_model_shape(spec, p.shape[:1], p.shape)) for p in parts]
            continue
        array = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)
        leading = (total,) if batched else ()
        arrays[name] = array.reshape(_model_shape(spec, leading, array.shape))
    for made in config.batch_inputs:
        arrays[made.target] = ragged.batch_input(made, _source_shapes(requests, made.source))
    return ragged.RaggedInputs(arrays, own) if own else arrays


def _input_array(tensor: TensorHeader, data: bytes | memoryview) -> np.ndarray:
    """Input ``tensor``'s array over ``data``. The gateway checked the BYTES elements of a
    client's region when it read the request, but the client may have written other length
    prefixes since: that is this request's 400 (:class:`InvalidInput`, so that the rest of
    its batch still runs), never the batch's failure."""
    try:
        return to_numpy(tensor.datatype, tensor.shape, data)
    except InvalidInput as exc:
        raise InvalidInput(f"input '{tensor.name}': {exc.message}") from None
    except ValueError:
        if tensor.datatype != BYTES:
            raise
        found, needed = count_bytes_elements(data), math.prod(tensor.shape)
    raise InvalidInput(
        f"input '{tensor.name}': its {len(data)} bytes hold {found} BYTES elements, shape "
        f"{list(tensor.shape)} needs {needed} (they changed since the request was read)"
    )


def _source_shapes(requests: Sequence[PendingRequest], name: str) -> list[tuple[int, ...] | None]:
    """Each request's shape of input ``name`` (None where it lacks it)."""
    shapes: list[tuple[int, ...] | None] = []
    for request in requests:
        found = next((t.shape for t in request.message.inputs if t.name == name), None)
        shapes.append(found)
    return shapes


def output_names(requests: Sequence[PendingRequest]) -> list[str]:
    names: dict[str, None] = {}
    for request in requests:
        names.update(dict.fromkeys(request.message.outputs))
    return list(names)


def split(
    requests: Sequence[PendingRequest],
    outputs: dict[str, np.ndarray],
    config: ModelConfig,
    labels: Mapping[str, Sequence[bytes]] | None = None,
    absent: Mapping[int, Collection[str]] | None = None,
) -> list[tuple[list[TensorHeader], bytes]]:
    """Each request's requested outputs as (headers, payload), in its requested order.

    An output the request asks to classify becomes its top classes (BYTES), named by
    ``labels`` (per output, from its ``label_filename``). An output the model did not
    produce (not in ``outputs``, or in ``absent[i]`` for request ``i``) is left out of the
    answer, as Triton leaves it out."""
    batched = config.max_batch_size > 0
    total = sum(r.items for r in requests)
    scatter = ragged.scatter_sources(config) if config.batch_outputs else {}
    parts = dict(ragged.own_outputs(outputs))
    for name, source in scatter.items():
        spec = config.output(name)
        if name in outputs and spec is not None:
            shapes = _source_shapes(requests, source)
            parts[name] = ragged.scattered(name, outputs[name], spec.dims, source, shapes)
    if batched:
        for name, array in outputs.items():
            if name in parts:
                continue
            if array.ndim == 0 or array.shape[0] != total:
                raise InferenceFailed(
                    f"output '{name}' has batch dimension {array.shape[:1]} for {total} batch items"
                )
    results: list[tuple[list[TensorHeader], bytes]] = []
    segments: list[str] = []
    start = 0
    try:
        for index, request in enumerate(requests):
            headers: list[TensorHeader] = []
            buffers: list[bytes | memoryview] = []
            classes = request.message.classes
            lacking = absent.get(index, ()) if absent else ()
            for name in request.message.outputs:
                if name not in outputs or name in lacking:
                    continue
                spec = config.output(name)
                assert spec is not None
                array = _part(outputs, parts, name, index, start, request.items, batched)
                if (
                    name not in parts
                    and spec.reshape is not None
                    and all(d >= 0 for d in spec.dims)
                ):
                    array = array.reshape(((request.items,) if batched else ()) + spec.dims)
                buffer: bytes | memoryview
                if classes and name in classes:
                    typed = np.asarray(array, dtype=numpy_dtype(spec.datatype))
                    names = (labels or {}).get(name, ())
                    shape, buffer = classify(typed, classes[name], batched, names)
                    header = TensorHeader(name, BYTES, shape, len(buffer))
                else:
                    buffer = to_buffer(spec.datatype, array)
                    header = TensorHeader(name, spec.datatype, tuple(array.shape), len(buffer))
                header.shm = _place(request.message, header, buffer, segments)
                if header.shm is None:
                    buffers.append(buffer)
                headers.append(header)
            results.append((headers, b"".join(buffers)))
            start += request.items
    except BaseException:
        for segment in segments:
            unlink(segment)
        raise
    return results


def _part(
    outputs: Mapping[str, np.ndarray],
    scattered: Mapping[str, list[np.ndarray]],
    name: str,
    index: int,
    start: int,
    items: int,
    batched: bool,
) -> np.ndarray:
    """Request ``index``'s part of output ``name``: scattered by an input's shape (ragged
    batching) or its own array (a Python model's output whose shapes differ), its rows of
    the batch, or the whole output of a model that does not batch."""
    if name in scattered:
        return scattered[name][index]
    return outputs[name][start : start + items] if batched else outputs[name]


def _place(
    message: RequestMessage, header: TensorHeader, buffer: bytes | memoryview, segments: list[str]
) -> ShmRef | None:
    """Where an output's bytes go when not inline: the client's region (if they fit;
    otherwise nothing is written and the gateway reports it), or a new segment."""
    region = message.output_regions.get(header.name)
    if region is not None:
        if header.nbytes <= region.byte_size:
            shm_io.write(region, buffer, f"output '{header.name}'")
        return region
    if message.segment_min_bytes and header.nbytes >= message.segment_min_bytes:
        name = new_segment_name(message.segment_prefix, "out")
        write_segment(name, [buffer])
        segments.append(name)
        return ShmRef(name, 0, header.nbytes)
    return None
