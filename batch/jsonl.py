"""JSON Lines batch jobs: each input line is a KServe v2 inference request (``inputs`` with
``name``, ``shape``, ``datatype`` and ``data``; optional ``id``), each output line the v2
response to it, in the same order (a line that fails, the v2 error response in its place).

A line comes from a client, so what it may cost is bounded before anything is built from
it: its length (``SLUICE_BATCH_MAX_LINE_BYTES``, read without holding more of the file),
its shape (the model's dims after a batch dimension of at most ``max_batch_size``), and
its elements, which must be as many as the shape says and each of the datatype's JSON
kind (numbers in range, true/false, strings for BYTES, as the online JSON route takes
them). The arrays built are then at most a small multiple of the line's length. Every
refusal is an :class:`~sluice.core.errors.InvalidInput` naming the line and the input: it fails
that line alone (its answer is the error), with no retry.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import IO, Any

import numpy as np
import orjson

from sluice.core.config import ModelConfig, TensorSpec
from sluice.core.datatypes import BYTES, element_count, from_numpy_dtype, numpy_dtype
from sluice.core.errors import InvalidInput
from sluice.core.fields import json_type

_SKIP_CHUNK = 1 << 20
_MAX_NAME = 100


def non_blank_lines(stream: IO[bytes], max_bytes: int) -> Iterator[tuple[int, bytes | None]]:
    """``(offset, line)`` for each non-blank line from the stream's position on; ``line`` is
    None for a line longer than ``max_bytes``, which is skipped, never held whole."""
    offset = stream.tell()
    while line := stream.readline(max_bytes + 1):
        start = offset
        offset += len(line)
        if line.endswith(b"\n") or len(line) <= max_bytes:
            if line.strip():
                yield start, line
            continue
        blank = not line.strip()
        while not line.endswith(b"\n"):
            line = stream.readline(_SKIP_CHUNK)
            if not line:
                break
            offset += len(line)
            blank = blank and not line.strip()
        if not blank:
            yield start, None


def parse_line(raw: bytes | None, where: str, max_bytes: int) -> Any:
    """One line's JSON, or InvalidInput naming the line."""
    if raw is None:
        raise InvalidInput(
            f"{where}: longer than {max_bytes} bytes (SLUICE_BATCH_MAX_LINE_BYTES); send "
            "fewer rows per line"
        )
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as exc:
        reason = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)[:200]
        raise InvalidInput(f"{where}: not JSON: {reason}") from None


def request_arrays(request: Any, config: ModelConfig, where: str) -> dict[str, np.ndarray]:
    """The inputs of one v2 request, checked against the model's configuration."""
    if not isinstance(request, dict) or not isinstance(request.get("inputs"), list):
        raise InvalidInput(f"{where}: a request must be an object with an 'inputs' list")
    arrays: dict[str, np.ndarray] = {}
    for position, item in enumerate(request["inputs"]):
        if not isinstance(item, dict):
            raise InvalidInput(f"{where}: input {position} must be an object")
        name = item.get("name")
        spec = config.input(name) if isinstance(name, str) else None
        if spec is None or not isinstance(name, str):
            shown = name[:_MAX_NAME] if isinstance(name, str) else json_type(name)
            raise InvalidInput(f"{where}: model '{config.name}' has no input {shown!r}")
        if name in arrays:
            raise InvalidInput(f"{where}: input '{name}' is given twice")
        datatype = item.get("datatype")
        if datatype != spec.datatype:
            shown = datatype[:_MAX_NAME] if isinstance(datatype, str) else json_type(datatype)
            raise InvalidInput(f"{where}: input '{name}' takes {spec.datatype}, not {shown!r}")
        label = f"{where}: input '{name}'"
        shape = _shape(item.get("shape"), spec, config, label)
        data = item.get("data")
        if not isinstance(data, list):
            raise InvalidInput(f"{label}: 'data' must be a list, got {json_type(data)}")
        count = element_count(shape)
        elements = _flatten(data, count, shape, label)
        flat = _bytes(elements, label) if datatype == BYTES else _numbers(elements, datatype, label)
        arrays[name] = flat.reshape(shape)
    missing = [s.name for s in config.inputs if not s.optional and s.name not in arrays]
    if missing:
        raise InvalidInput(f"{where}: input '{missing[0]}' is missing")
    rows = {len(a) for a in arrays.values()}
    if len(rows) != 1:
        raise InvalidInput(f"{where}: the inputs do not have the same batch size")
    return arrays


def _shape(shape: Any, spec: TensorSpec, config: ModelConfig, label: str) -> list[int]:
    """The request's shape: a batch dimension of at most ``max_batch_size``, then the
    model's dims (any size where a dim is -1)."""
    dims = list(spec.dims)
    wanted = f"[rows, {', '.join(str(d) for d in dims)}]" if dims else "[rows]"
    if (
        not isinstance(shape, list)
        or len(shape) != len(dims) + 1
        or not all(_dimension(d) for d in shape)
    ):
        raise InvalidInput(
            f"{label}: 'shape' must be {len(dims) + 1} non-negative integers {wanted} "
            "(-1 in the model's dims: any size)"
        )
    if any(want != -1 and got != want for got, want in zip(shape[1:], dims, strict=True)):
        raise InvalidInput(f"{label}: shape {shape} does not fit the model's {wanted}")
    if config.max_batch_size > 0 and shape[0] > config.max_batch_size:
        raise InvalidInput(
            f"{label}: {shape[0]} rows in one line, but model '{config.name}' takes at most "
            f"{config.max_batch_size} per request (max_batch_size)"
        )
    return shape


def _dimension(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 31


def _flatten(data: list[Any], count: int, shape: list[int], label: str) -> list[Any]:
    """The leaves of ``data`` in row-major order (nesting may be ragged, as Triton allows),
    walked without recursion and abandoned as soon as there are more than ``count``."""
    out: list[Any] = []
    stack = [iter(data)]
    while stack:
        for item in stack[-1]:
            if isinstance(item, list):
                stack.append(iter(item))
                break
            out.append(item)
            if len(out) > count:
                raise InvalidInput(
                    f"{label}: 'data' holds more than the {count} elements of shape {shape}"
                )
        else:
            stack.pop()
    if len(out) != count:
        raise InvalidInput(
            f"{label}: 'data' holds {len(out)} elements; shape {shape} needs {count}"
        )
    return out


def _bytes(elements: list[Any], label: str) -> np.ndarray:
    flat = np.empty(len(elements), dtype=object)
    for index, value in enumerate(elements):
        if not isinstance(value, str):
            raise InvalidInput(
                f"{label} element {index} must be a string, got {json_type(value)} "
                "(BYTES data is given as strings)"
            )
        flat[index] = value.encode()
    return flat


def _numbers(elements: list[Any], datatype: str, label: str) -> np.ndarray:
    """Numbers of ``datatype``, each a JSON number (or true/false) in the type's range."""
    target = numpy_dtype(datatype)
    for index, value in enumerate(elements):
        # (Before numpy sees them: a long string among numbers would make it a fixed-width
        # string array, every element as wide as that string.)
        if not isinstance(value, int | float):  # (bool is an int)
            raise InvalidInput(f"{label} element {index} must be a number, got {json_type(value)}")
    array: np.ndarray = np.asarray(elements) if elements else np.zeros(0, dtype=target)
    if array.dtype.kind not in "biuf":
        for index, value in enumerate(elements):
            if isinstance(value, int) and not -(1 << 63) <= value < 1 << 64:
                raise InvalidInput(f"{label} element {index} is out of range for {datatype}")
        array = np.asarray(elements, dtype=np.float64)  # (int64 and uint64 values mixed)
    kind = array.dtype.kind
    if datatype == "BOOL":
        if kind == "f" or (kind in "iu" and not ((array == 0) | (array == 1)).all()):
            raise InvalidInput(f"{label}: BOOL data must be true/false (or 0/1)")
        return array.astype(np.bool_)
    if target.kind in "iu":
        if kind == "f":
            if not all(type(v) is int or isinstance(v, bool) for v in elements):
                raise InvalidInput(f"{label}: {datatype} data must be integers")
            low, high = min(elements), max(elements)
        else:
            low, high = (int(array.min()), int(array.max())) if array.size else (0, 0)
        info = np.iinfo(target)
        if low < info.min or high > info.max:
            bad = low if low < info.min else high
            raise InvalidInput(
                f"{label}: value {bad} is out of range for {datatype} [{info.min}, {info.max}]"
            )
        return np.array(elements, dtype=target) if kind == "f" else array.astype(target)
    try:
        with np.errstate(over="raise", invalid="raise"):
            return array.astype(target)
    except FloatingPointError:
        raise InvalidInput(f"{label}: a value is out of range for {datatype}") from None


def answer_line(
    request: dict[str, Any], model: str, version: int, outputs: dict[str, np.ndarray]
) -> bytes:
    """The v2 response to ``request`` as one JSON line."""
    body: dict[str, Any] = {"model_name": model, "model_version": str(version)}
    if isinstance(request.get("id"), str):
        body["id"] = request["id"]
    body["outputs"] = [
        {
            "name": name,
            "datatype": _datatype(array),
            "shape": list(array.shape),
            "data": [
                v.decode(errors="replace") if isinstance(v, bytes) else v
                for v in array.reshape(-1).tolist()
            ],
        }
        for name, array in outputs.items()
    ]
    return orjson.dumps(body)


def error_line(request: Any, model: str, version: int, error: str) -> bytes:
    """The answer to a request that failed (it was not a request the model takes, or the
    model answered it with an error) as one JSON line: KServe v2's error response, with the
    request's ``id`` when it had one, in the place of its answer."""
    body: dict[str, Any] = {"model_name": model, "model_version": str(version)}
    if isinstance(request, dict) and isinstance(request.get("id"), str):
        body["id"] = request["id"]
    body["error"] = error
    return orjson.dumps(body)


def _datatype(array: np.ndarray) -> str:
    return from_numpy_dtype(array.dtype)
