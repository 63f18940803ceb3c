"""Warm-up from the configuration's ``model_warmup`` before a worker takes traffic.

As in Triton: each sample runs ``count`` times (at least once); a sample of
``batch_size`` N is N requests of one item each, run as one batch; samples with
``batch_size`` 0 are skipped; ``input_data_file`` names a file in ``<model>/warmup/``
holding raw row-major data (BYTES elements length-prefixed) for one batch item,
or for the whole batch. Random data is seeded, so warm-up is repeatable.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from sluice.core import datatypes
from sluice.core.config import ModelConfig, TensorSpec, WarmupInput, WarmupSample
from sluice.core.errors import InferenceFailed, InvalidConfig, InvalidInput, SluiceError
from sluice.workers.backends.base import Backend

WARMUP_FOLDER = "warmup"
_SEED = 0


def warm_up(backend: Backend, config: ModelConfig, model_dir: Path) -> None:
    """Run every warm-up sample; raise InvalidConfig naming the sample when one fails."""
    outputs = [spec.name for spec in config.outputs]
    for sample in config.warmup:
        if sample.batch_size == 0:
            continue
        batch = sample.batch_size if config.max_batch_size > 0 else None
        try:
            inputs = sample_inputs(sample, config, model_dir)
            for _ in range(max(1, sample.count)):
                results = backend.infer(inputs, outputs, request_sizes=[1] * (batch or 1))
                _check_outputs(results, outputs, batch)
        except Exception as exc:
            reason = exc.message if isinstance(exc, SluiceError) else f"{type(exc).__name__}: {exc}"
            raise InvalidConfig(f"warm-up '{sample.name}' failed: {reason}") from None


def sample_inputs(
    sample: WarmupSample, config: ModelConfig, model_dir: Path
) -> dict[str, np.ndarray]:
    """The batch a warm-up sample sends, shaped as :func:`sluice.workers.tensors.combine`
    shapes it."""
    rng = np.random.default_rng(_SEED)
    batch = sample.batch_size if config.max_batch_size > 0 else None
    arrays: dict[str, np.ndarray] = {}
    for warmup_input in sample.inputs:
        spec = config.input(warmup_input.name)
        if spec is None:
            raise InvalidConfig(f"'{warmup_input.name}' is not an input of the model")
        if spec.datatype != warmup_input.datatype:
            raise InvalidConfig(
                f"input '{spec.name}' is {spec.datatype} in the model "
                f"but {warmup_input.datatype} in the sample"
            )
        _check_dims(spec, warmup_input.dims)
        array = _data(warmup_input, batch, rng, model_dir)
        if spec.reshape is not None:
            array = array.reshape(((batch,) if batch else ()) + spec.reshape)
        arrays[spec.name] = array
    missing = [s.name for s in config.inputs if not s.optional and s.name not in arrays]
    if missing:
        raise InvalidConfig(f"the sample has no data for input '{missing[0]}'")
    return arrays


def _check_dims(spec: TensorSpec, dims: tuple[int, ...]) -> None:
    fits = len(dims) == len(spec.dims) and all(
        want in (-1, got) for want, got in zip(spec.dims, dims, strict=True)
    )
    if not fits:
        raise InvalidConfig(
            f"input '{spec.name}': sample dims {list(dims)} do not fit the model's "
            f"dims {list(spec.dims)}"
        )


def _data(
    warmup_input: WarmupInput, batch: int | None, rng: np.random.Generator, model_dir: Path
) -> np.ndarray:
    leading = (batch,) if batch else ()
    shape = leading + warmup_input.dims
    datatype = warmup_input.datatype
    if warmup_input.source == "zero":
        if datatype == datatypes.BYTES:
            return _bytes_array([b""] * datatypes.element_count(shape), shape)
        return np.zeros(shape, dtype=datatypes.numpy_dtype(datatype))
    if warmup_input.source == "random":
        return _random(datatype, shape, rng)
    return _from_file(warmup_input, leading, model_dir)


def _bytes_array(elements: list[bytes], shape: tuple[int, ...]) -> np.ndarray:
    array = np.empty(len(elements), dtype=np.object_)
    array[:] = elements
    return array.reshape(shape)


def _random(datatype: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    dtype = datatypes.numpy_dtype(datatype)
    if datatype == datatypes.BYTES:
        letters = rng.integers(ord("a"), ord("z") + 1, size=(datatypes.element_count(shape), 8))
        return _bytes_array([bytes(row.astype(np.uint8)) for row in letters], shape)
    if dtype.kind == "b":
        return rng.integers(0, 2, size=shape).astype(dtype)
    if dtype.kind in "iu":
        return rng.integers(0, 16, size=shape).astype(dtype)
    return rng.random(shape).astype(dtype)


def _from_file(warmup_input: WarmupInput, leading: tuple[int, ...], model_dir: Path) -> np.ndarray:
    relative = f"{WARMUP_FOLDER}/{warmup_input.file}"
    path = model_dir / WARMUP_FOLDER / warmup_input.file
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise InvalidConfig(f"input '{warmup_input.name}': {relative} does not exist") from None
    except OSError as exc:
        raise InvalidConfig(f"input '{warmup_input.name}': cannot read {relative}: {exc}") from None
    datatype = warmup_input.datatype
    per_item = datatypes.element_count(warmup_input.dims)
    if datatype == datatypes.BYTES:
        try:
            found = datatypes.count_bytes_elements(raw)
        except InvalidInput as exc:
            raise InvalidConfig(f"input '{warmup_input.name}': {relative}: {exc.message}") from None
    else:
        size = datatypes.ELEMENT_SIZE[datatype]
        found = len(raw) // size if len(raw) % size == 0 else -1
    whole_batch = per_item * datatypes.element_count(leading)
    if found == whole_batch:
        return datatypes.to_numpy(datatype, leading + warmup_input.dims, raw)
    if found == per_item:
        item = datatypes.to_numpy(datatype, warmup_input.dims, raw)
        return np.broadcast_to(item, leading + item.shape).copy() if leading else item
    raise InvalidConfig(
        f"input '{warmup_input.name}': {relative} holds {max(found, 0)} {datatype} "
        f"element(s) ({len(raw)} bytes); expected {per_item} (dims {list(warmup_input.dims)})"
        + (f" or {whole_batch} (the whole batch)" if leading else "")
    )


def _check_outputs(results: dict[str, np.ndarray], outputs: list[str], batch: int | None) -> None:
    for name in outputs:
        array = results.get(name)
        if array is None:
            raise InferenceFailed(f"the model returned no output '{name}'")
        if batch is not None and (array.ndim == 0 or array.shape[0] != batch):
            raise InferenceFailed(
                f"output '{name}' has shape {list(array.shape)} for a batch of {batch}"
            )
