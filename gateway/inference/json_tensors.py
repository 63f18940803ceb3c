"""JSON tensor data: converting a KServe v2 ``data`` value to Triton's binary layout.

Inputs given as JSON are converted once, through numpy, with every element checked
against the datatype (integers in range, booleans, strings for BYTES) and the element
count against the shape. Ragged nesting is flattened in order, as Triton does, down to
Triton's depth limit (100). Nesting is walked with an explicit stack, never by recursion;
numpy's one-pass conversion, tried first, gives up at once on data nested deeper than an
array's 64 dimensions.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from sluice.core.datatypes import BF16, BYTES, numpy_dtype, serialize_bytes, to_buffer
from sluice.core.errors import InvalidInput
from sluice.core.fields import json_type

_SHAPE_MISMATCH = "Unable to parse 'data': Shape does not match true shape of 'data' field"
"""Triton's text (server ``ReadDataFromJson``) for JSON data of the wrong element count."""


class BytesCountMismatch(InvalidInput):
    """BYTES data with the wrong element count: the caller words it as Triton's core does
    (it knows the model and the request id)."""

    def __init__(self, message: str, found: int) -> None:
        super().__init__(message)
        self.found = found


# numpy dtype kind -> how a JSON value of that kind is described in messages.
_KIND_NAMES = {
    "b": "booleans",
    "i": "integers",
    "u": "integers",
    "f": "non-integer numbers",
    "U": "strings",
    "S": "strings",
    "O": "objects",
}


def json_to_buffer(
    label: str, datatype: str, shape: tuple[int, ...], count: int, data: Any, max_depth: int
) -> bytes | memoryview:
    """The binary layout of an input's JSON ``data`` (flat or nested), checked against
    its datatype and element count."""
    if not isinstance(data, list):
        raise InvalidInput(f"{label}: 'data' must be a list, got {json_type(data)}")
    if datatype == BYTES:
        return _json_bytes(label, shape, count, data, max_depth)

    # Fast path: numpy reads a flat or regularly nested list in one C pass.
    array: np.ndarray | None
    try:
        array = np.asarray(data)
    except (ValueError, TypeError, OverflowError):
        array = None  # ragged nesting
    if array is not None and array.dtype.kind != "O":
        if array.ndim > max_depth:
            raise too_deep(label, max_depth)
    else:
        flat = _flatten(label, data, max_depth)
        for item in flat:
            if not isinstance(item, int | float):  # bool is an int
                raise InvalidInput(
                    f"{label}: {datatype} data must be numbers, got {json_type(item)}"
                )
        try:
            array = np.asarray(flat)
        except (ValueError, TypeError, OverflowError):  # pragma: no cover - defensive
            array = np.asarray(flat, dtype=np.object_)
        if array.dtype.kind == "O":  # only integers beyond 64 bits get here
            raise InvalidInput(f"{label}: a value is out of range for {datatype}")

    if array.size != count:
        raise InvalidInput(
            f"{_SHAPE_MISMATCH}; {label}: shape {fmt_shape(shape)} needs {count} elements, "
            f"got {array.size}"
        )
    array = array.reshape(-1)
    target = numpy_dtype(datatype)
    kind = array.dtype.kind
    if array.size == 0:
        return b""
    if datatype == "BOOL":
        if kind in "iu":
            if not ((array == 0) | (array == 1)).all():
                raise InvalidInput(
                    f"{label}: BOOL data must be true/false (or 0/1), got other integers"
                )
        elif kind != "b":
            raise InvalidInput(
                f"{label}: BOOL data must be true/false (or 0/1), got {_KIND_NAMES.get(kind, kind)}"
            )
        return to_buffer(datatype, array.astype(np.bool_))
    if target.kind in "iu":
        info = np.iinfo(target)
        if kind == "f":
            # numpy infers float64 for integers that share no 64-bit type (e.g.
            # 2**63 next to 0): keep them exact when every value is an integer.
            flat = _flatten(label, data, max_depth)
            if not all(type(item) is int for item in flat):
                raise InvalidInput(
                    f"{label}: {datatype} data must be integers, got non-integer numbers"
                )
            low, high = min(flat), max(flat)
            if low >= info.min and high <= info.max:
                return to_buffer(datatype, np.array(flat, dtype=target))
        elif kind not in "iu":
            raise InvalidInput(
                f"{label}: {datatype} data must be integers, got {_KIND_NAMES.get(kind, kind)}"
            )
        else:
            low, high = int(array.min()), int(array.max())
        if low < info.min or high > info.max:
            bad = low if low < info.min else high
            raise InvalidInput(
                f"{label}: value {bad} is out of range for {datatype} [{info.min}, {info.max}]"
            )
        return to_buffer(datatype, array)
    # FP16, FP32, FP64, BF16
    if kind not in "iuf":
        raise InvalidInput(
            f"{label}: {datatype} data must be numbers, got {_KIND_NAMES.get(kind, kind)}"
        )
    try:
        with np.errstate(over="raise", invalid="raise"):
            converted = array.astype(np.float32 if datatype == BF16 else target)
    except FloatingPointError:
        raise InvalidInput(f"{label}: a value is out of range for {datatype}") from None
    return to_buffer(datatype, converted)


def _json_bytes(label: str, shape: tuple[int, ...], count: int, data: Any, max_depth: int) -> bytes:
    flat = _flatten(label, data, max_depth)
    for item in flat:
        if not isinstance(item, str):
            raise InvalidInput(f"{label}: BYTES data must be strings, got {json_type(item)}")
    if len(flat) != count:
        raise BytesCountMismatch(
            f"{label}: shape {fmt_shape(shape)} needs {count} elements, got {len(flat)}",
            len(flat),
        )
    return serialize_bytes(flat)


def _flatten(label: str, data: list[Any], max_depth: int) -> list[Any]:
    """Row-major leaves of a (possibly ragged) nested list; ``data`` is depth 1."""
    if max_depth < 1:
        raise too_deep(label, max_depth)
    out: list[Any] = []
    stack = [iter(data)]
    while stack:
        for item in stack[-1]:
            if isinstance(item, list):
                if len(stack) >= max_depth:
                    raise too_deep(label, max_depth)
                stack.append(iter(item))
                break
            out.append(item)
        else:
            stack.pop()
    return out


def nesting_message(max_depth: int) -> str:
    """Triton's text (server ``ReadDataFromJson``) for JSON nested deeper than its limit."""
    return f"Unable to parse 'data': JSON nesting depth exceeds maximum allowed limit ({max_depth})"


def too_deep(label: str, max_depth: int) -> InvalidInput:
    return InvalidInput(
        f"{nesting_message(max_depth)}; {label}: 'data' is nested deeper than {max_depth} levels"
    )


def fmt_shape(shape: Sequence[int]) -> str:
    return "[" + ",".join(str(dim) for dim in shape) + "]"
