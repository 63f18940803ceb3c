"""The parameters Triton's HTTP frontend reads itself (server ``src/http_server.cc``), each
checked as that frontend reads it, with its texts: a JSON value of the wrong type (or out of
its range) is refused with ``Unable to parse '<name>': `` (``Unable to set`` for an output's
``classification``) followed by the text of Triton's JSON reader for the type it wanted.

Each check looks at one value: a constant cost per parameter named.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sluice.core.errors import InvalidInput

NON_UNSIGNED = "attempt to access JSON non-unsigned-integer as unsigned-integer"
NON_BOOLEAN = "attempt to access JSON non-boolean as boolean"
NON_STRING = "attempt to access JSON non-string as string"
"""Triton's JSON reader's texts for a value that is not of the type asked for."""

MAX_UINT64 = (1 << 64) - 1

RESERVED_PREFIX = "triton_"
RESERVED_TEXT = (
    f"parameter keys starting with '{RESERVED_PREFIX}' are reserved for Triton usage and "
    "should not be specified."
)
"""Triton's HTTP answer to a request parameter in its reserved space."""

CUSTOM_TYPE_TEXT = (
    "parameter '{}' has invalid type. It should be either 'int', 'bool', or 'string'."
)
"""Triton's HTTP answer to a request parameter of its own that is not a scalar."""


def is_uint64(value: Any) -> bool:
    """Whether a JSON value is one Triton reads as an unsigned 64-bit integer: an integer
    (not a boolean, not a number with a fraction or an exponent) in 0..2^64-1."""
    return type(value) is int and 0 <= value <= MAX_UINT64


def unparsable(name: str, reason: str, verb: str = "parse") -> str:
    """Triton's text refusing parameter ``name`` that is not of the type it reads."""
    return f"Unable to {verb} '{name}': {reason}"


def uint64_parameter(name: str, value: Any, suffix: str = "") -> int:
    """``value`` as Triton reads an unsigned 64-bit parameter; ``suffix`` follows its text
    (Sluice's naming of the tensor)."""
    if not is_uint64(value):
        raise InvalidInput(unparsable(name, NON_UNSIGNED) + suffix)
    result: int = value
    return result


def _is_bool(value: Any) -> bool:
    return isinstance(value, bool)


def _is_correlation_id(value: Any) -> bool:
    return isinstance(value, str) or is_uint64(value)


_READ: dict[str, tuple[Callable[[Any], bool], str]] = {
    "sequence_id": (_is_correlation_id, NON_STRING),
    "sequence_start": (_is_bool, NON_BOOLEAN),
    "sequence_end": (_is_bool, NON_BOOLEAN),
    "priority": (is_uint64, NON_UNSIGNED),
    "timeout": (is_uint64, NON_UNSIGNED),
    "binary_data_output": (_is_bool, NON_BOOLEAN),
}
"""The request parameters Triton's HTTP frontend reads itself: the values it takes for
each (``sequence_id``: an unsigned integer, else a string), and its text for another."""


def check_request_parameter(key: str, item: Any) -> None:
    """Refuse a request parameter that Triton's HTTP frontend reads itself when it is not
    of the type it reads (:data:`_READ`). Other names pass."""
    rule = _READ.get(key)
    if rule is not None and not rule[0](item):
        raise InvalidInput(unparsable(key, rule[1]))
