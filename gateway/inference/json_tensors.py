"""JSON tensor data: converting a KServe v2 ``data`` value to Triton's binary layout.

Inputs given as JSON are converted once, with every element checked against the datatype
(integers in range, booleans, strings for BYTES) and the element count against the shape.
Numbers are read by the standard ``array`` type, in one C pass that fails at the first
value of another type: numpy's own inference would make a list holding a string into a
fixed-width string array, every element as wide as the longest string (a body of a few
KiB could cost GiBs); the message then says which value is wrong, and why.

Ragged nesting is flattened in order, as Triton does, down to Triton's depth limit (100):
level by level in C where each level is all lists, with an explicit stack where a level
mixes lists and values; never by recursion.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from itertools import chain
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


_NUMBERS = frozenset((int, float, bool))
"""The types of the JSON values a tensor of numbers may hold (as orjson decodes them)."""
_NONE = object()  # (no element: a JSON null is one)


def json_to_buffer(
    label: str, datatype: str, shape: tuple[int, ...], count: int, data: Any, max_depth: int
) -> bytes | memoryview:
    """The binary layout of an input's JSON ``data`` (flat or nested), checked against
    its datatype and element count."""
    if not isinstance(data, list):
        raise InvalidInput(f"{label}: 'data' must be a list, got {json_type(data)}")
    if datatype == BYTES:
        return _json_bytes(label, shape, count, *_leaves(label, data, max_depth))
    flat: list[Any] = data
    if len(data) != count or (data and type(data[0]) is list):
        flat = _counted(label, shape, count, data, max_depth)
    if not flat:
        return b""
    converted = _numbers(label, datatype, flat)
    if converted is None and flat is data and list in map(type, data):  # ragged after all
        flat = _counted(label, shape, count, data, max_depth)
        converted = _numbers(label, datatype, flat)
    if converted is None:
        raise _refusal(label, datatype, flat)
    return converted


def _counted(
    label: str, shape: tuple[int, ...], count: int, data: list[Any], max_depth: int
) -> list[Any]:
    """The leaves of ``data``, as many as the shape holds."""
    flat, _ = _leaves(label, data, max_depth)
    if len(flat) != count:
        raise InvalidInput(
            f"{_SHAPE_MISMATCH}; {label}: shape {fmt_shape(shape)} needs {count} elements, "
            f"got {len(flat)}"
        )
    return flat


def _numbers(label: str, datatype: str, flat: list[Any]) -> bytes | memoryview | None:
    """The binary layout of ``flat`` (leaves, at least one) as ``datatype``; None when a
    value is not a number of that type (:func:`_refusal` says which)."""
    target = numpy_dtype(datatype)
    integral = datatype == "BOOL" or target.kind in "iu"
    values: np.ndarray
    try:  # (a float is no integer here, as in Triton's JSON reader: 1.0 is refused too)
        values = np.frombuffer(
            array("q" if integral else "d", flat), np.int64 if integral else np.float64
        )
    except TypeError:
        return None
    except OverflowError:  # beyond int64: a UINT64 may be
        if datatype != "UINT64":
            return None
        try:
            values = np.frombuffer(array("Q", flat), np.uint64)
        except (TypeError, OverflowError):
            return None
    if type(flat[0]) is bool and datatype != "BOOL" and set(map(type, flat)) == {bool}:
        raise InvalidInput(f"{label}: {datatype} data must be {_wanted(datatype)}, got booleans")
    if datatype == "BOOL":
        if not ((values == 0) | (values == 1)).all():
            raise InvalidInput(
                f"{label}: BOOL data must be true/false (or 0/1), got other integers"
            )
        return to_buffer(datatype, values.astype(np.bool_))
    if integral:
        info = np.iinfo(target)
        low, high = int(values.min()), int(values.max())
        if low < info.min or high > info.max:
            bad = low if low < info.min else high
            raise InvalidInput(
                f"{label}: value {bad} is out of range for {datatype} [{info.min}, {info.max}]"
            )
        return to_buffer(datatype, values)
    # FP16, FP32, FP64, BF16
    try:
        with np.errstate(over="raise", invalid="raise"):
            converted = values.astype(np.float32 if datatype == BF16 else target)
    except FloatingPointError:
        raise InvalidInput(f"{label}: a value is out of range for {datatype}") from None
    return to_buffer(datatype, converted)


def _refusal(label: str, datatype: str, flat: list[Any]) -> InvalidInput:
    """Why :func:`_numbers` could not read ``flat`` as ``datatype`` (a refusal's slow path)."""
    odd = next((item for item in flat if type(item) not in _NUMBERS), _NONE)
    if odd is not _NONE:
        shown = "strings" if isinstance(odd, str) else json_type(odd)
        return InvalidInput(f"{label}: {datatype} data must be {_wanted(datatype)}, got {shown}")
    floats = any(type(item) is float for item in flat)
    if datatype == "BOOL":
        shown = "non-integer numbers" if floats else "other integers"
        return InvalidInput(f"{label}: BOOL data must be true/false (or 0/1), got {shown}")
    target = numpy_dtype(datatype)
    if target.kind not in "iu":
        return InvalidInput(f"{label}: a value is out of range for {datatype}")
    if floats:
        return InvalidInput(f"{label}: {datatype} data must be integers, got non-integer numbers")
    info = np.iinfo(target)
    low, high = min(flat), max(flat)
    bad = low if low < info.min else high
    return InvalidInput(
        f"{label}: value {bad} is out of range for {datatype} [{info.min}, {info.max}]"
    )


def _wanted(datatype: str) -> str:
    """What the elements of a ``datatype`` tensor must be, in messages."""
    if datatype == "BOOL":
        return "true/false (or 0/1)"
    return "integers" if numpy_dtype(datatype).kind in "iu" else "numbers"


def _json_bytes(
    label: str, shape: tuple[int, ...], count: int, flat: list[Any], types: set[type]
) -> bytes:
    if not types <= {str}:
        odd = next(item for item in flat if not isinstance(item, str))
        raise InvalidInput(f"{label}: BYTES data must be strings, got {json_type(odd)}")
    if len(flat) != count:
        raise BytesCountMismatch(
            f"{label}: shape {fmt_shape(shape)} needs {count} elements, got {len(flat)}",
            len(flat),
        )
    return serialize_bytes(flat)


def flatten(label: str, value: Any, max_depth: int) -> list[Any]:
    """The row-major elements of ``value`` (one element, or a nested list of them at most
    ``max_depth`` levels deep), without recursion: a client's nesting can be as deep as the
    JSON parser allows. Deeper is refused with Triton's text, naming ``label``."""
    if not isinstance(value, list):
        return [value]
    return _leaves(label, value, max_depth)[0]


def _leaves(label: str, data: list[Any], max_depth: int) -> tuple[list[Any], set[type]]:
    """Row-major leaves of a (possibly ragged) nested list, ``data`` being depth 1, and
    their types. Regular nesting (each level all lists, or no lists) is flattened a level
    at a time in C; from a level that mixes lists and values, :func:`_walk` takes over."""
    if max_depth < 1:
        raise too_deep(label, max_depth)
    level, depth = data, 1
    while True:
        types = set(map(type, level))
        if list not in types:
            return level, types
        if len(types) > 1:  # ragged from here: the walk's level 1 is this one
            flat = _walk(label, level, max_depth - depth + 1, max_depth)
            return flat, set(map(type, flat))
        if depth >= max_depth:
            raise too_deep(label, max_depth)
        level = list(chain.from_iterable(level))
        depth += 1


def _walk(label: str, data: list[Any], room: int, max_depth: int) -> list[Any]:
    """Row-major leaves of a ragged nested list at most ``room`` levels deep (``data`` is
    level 1); ``max_depth``: the limit messages name."""
    out: list[Any] = []
    stack = [iter(data)]
    while stack:
        for item in stack[-1]:
            if isinstance(item, list):
                if len(stack) >= room:
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
