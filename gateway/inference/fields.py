"""The request's own JSON fields (``id``, ``parameters``) and the field rules its tensors
share (shapes)."""

from __future__ import annotations

import math
from typing import Any

from sluice.core.datatypes import ELEMENT_SIZE
from sluice.core.errors import InvalidInput
from sluice.core.fields import json_type
from sluice.gateway.inference.json_parameters import (
    CUSTOM_TYPE_TEXT,
    RESERVED_PREFIX,
    RESERVED_TEXT,
    check_request_parameter,
)
from sluice.gateway.inference.json_tensors import fmt_shape
from sluice.gateway.inference.request import RequestLimits

TRITON_PARAMETERS = frozenset({"triton_enable_empty_final_response"})
"""Reserved names Triton's gRPC frontend reads itself (streams of decoupled models). Triton's
HTTP frontend refuses every reserved name: ``/infer`` takes none
(:func:`sluice.gateway.inference.parsing.parse_infer_request`); its generate extension
checks none (``allowed=None``: each goes to the model as any other parameter)."""


_MAX_DIM = (1 << 63) - 1
MAX_DIMS = 64
"""The most dims a tensor may have (REST and gRPC): numpy's most, so no worker could hold
more. A longer shape is refused before its dims are read (their checks and an error text
naming the shape would take some fifty times the bytes it came in)."""
"""Triton holds dims, element counts and byte sizes in signed 64-bit integers."""


def parse_id(value: Any, limits: RequestLimits) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise InvalidInput(f"request 'id' must be a string, got {json_type(value)}")
    if len(value) > limits.max_string_length:
        raise InvalidInput(f"request 'id' is longer than {limits.max_string_length} characters")
    return value


def tensor_entry(
    field: str, index: int, item: Any, limits: RequestLimits
) -> tuple[dict[str, Any], str]:
    """Entry ``index`` of the request's ``inputs`` or ``outputs`` (``field``): an object,
    and its ``name``, a string no longer than the limit."""
    if not isinstance(item, dict):
        raise InvalidInput(f"{field}[{index}] must be an object, got {json_type(item)}")
    name = item.get("name")
    if not isinstance(name, str):
        if name is None:
            raise InvalidInput(f"{field}[{index}]: 'name' is required")
        raise InvalidInput(f"{field}[{index}]: 'name' must be a string, got {json_type(name)}")
    if len(name) > limits.max_string_length:
        raise InvalidInput(
            f"{field}[{index}]: 'name' is longer than {limits.max_string_length} characters"
        )
    return item, name


def parse_request_parameters(
    value: Any, limits: RequestLimits, allowed: frozenset[str] | None = TRITON_PARAMETERS
) -> tuple[dict[str, Any], bool | None]:
    """The request's parameters but ``binary_data_output``, and that (None when absent).
    At most ``limits.max_parameters`` of them, names within ``limits.max_string_length``;
    a number is finite (the JSON text a Python model reads can hold no other). Those
    Triton's HTTP frontend reads are checked in order as it reads them, with its texts
    (:mod:`sluice.gateway.inference.json_parameters`); a name starting with ``triton_``
    is refused unless ``allowed`` (a boolean then), or ``allowed`` is None (Triton's
    generate extension: such a name is a parameter as any other)."""
    if value is None:
        return {}, None
    if not isinstance(value, dict):
        raise InvalidInput(f"request 'parameters' must be an object, got {json_type(value)}")
    if len(value) > limits.max_parameters:
        raise InvalidInput(
            f"request 'parameters' has {len(value)} entries, more than the limit of "
            f"{limits.max_parameters}"
        )
    parameters: dict[str, Any] = {}
    binary_default: bool | None = None
    for key, item in value.items():
        if len(key) > limits.max_string_length:
            raise InvalidInput(
                f"request parameter '{key[:64]}...': the name is longer than "
                f"{limits.max_string_length} characters"
            )
        check_request_parameter(key, item)
        if allowed is not None and key.startswith(RESERVED_PREFIX):
            if key not in allowed:
                raise InvalidInput(RESERVED_TEXT)
            if not isinstance(item, bool):
                raise InvalidInput(f"request parameter '{key}' must be a boolean")
        if not isinstance(item, str | int | float):  # bool is an int
            raise InvalidInput(CUSTOM_TYPE_TEXT.format(key))
        if isinstance(item, float) and not math.isfinite(item):  # (gRPC's double_param)
            raise InvalidInput(f"request parameter '{key}' must be a finite number, got {item}")
        if key == "binary_data_output":
            binary_default = item is True  # (a boolean: checked above)
        else:
            parameters[key] = item
    return parameters, binary_default


def parse_shape(label: str, value: Any) -> tuple[int, ...]:
    if value is None:
        raise InvalidInput(f"{label}: 'shape' is required")
    if not isinstance(value, list):
        raise InvalidInput(f"{label}: 'shape' must be a list, got {json_type(value)}")
    if len(value) > MAX_DIMS:
        raise InvalidInput(
            f"{label}: 'shape' has {len(value)} dims, more than the limit of {MAX_DIMS}"
        )
    for index, dim in enumerate(value):
        if isinstance(dim, bool) or not isinstance(dim, int) or not 0 <= dim <= _MAX_DIM:
            shown = dim if isinstance(dim, int) and not isinstance(dim, bool) else json_type(dim)
            raise InvalidInput(
                f"{label}: 'shape' dim {index} must be a non-negative integer, got {shown}"
            )
    return tuple(value)


def check_size_fits(name: str, shape: tuple[int, ...], datatype: str) -> None:
    """Triton's overflow checks, with its texts: an input's element count, then its byte
    size, must fit in a signed 64-bit integer. Made as the input is read, before anything
    is checked against the model (as Triton's HTTP frontend does), in one pass over the
    dims that stops at the first overflow."""
    if 0 in shape:
        return
    count = 1
    for dim in shape:
        count *= dim
        if count > _MAX_DIM:
            raise InvalidInput(
                f"input '{name}': the shape {fmt_shape(shape)} causes total element count to "
                f"exceed maximum size of {_MAX_DIM}"
            )
    element_size = ELEMENT_SIZE.get(datatype)
    if element_size is not None and count * element_size > _MAX_DIM:
        raise InvalidInput(
            f"byte size overflow for input '{name}': shape {fmt_shape(shape)} of {datatype} "
            f"is {count * element_size} bytes, more than {_MAX_DIM}"
        )
