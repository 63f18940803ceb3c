"""Which request parameters a model sees: Triton gives a model (``request.parameters()`` in
a Python model) the request's own parameters, not those it reserves for itself (sequence
ids and flags, priority, timeout, ``binary_data_output``, ``headers``, and every name
starting with ``triton_``), and an ensemble passes them on to each of its steps."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

RESERVED = frozenset(
    {
        "sequence_id",
        "sequence_start",
        "sequence_end",
        "priority",
        "timeout",
        "headers",
        "binary_data_output",
    }
)
"""Triton's reserved request parameters (and every name starting with :data:`PREFIX`)."""
PREFIX = "triton_"


_CASE_SENSITIVE = "(?-i)"


def forward_pattern(text: str) -> re.Pattern[str] | None:
    """A header-forward pattern as Triton reads it (``--http-header-forward-pattern``):
    matched ignoring case unless it starts with ``(?-i)``; None when empty; ``re.error``
    when it is not a regular expression."""
    if not text:
        return None
    if text.startswith(_CASE_SENSITIVE):
        return re.compile(text[len(_CASE_SENSITIVE) :])
    return re.compile(text, re.IGNORECASE)


def is_reserved(name: str) -> bool:
    """Whether ``name`` is one of Triton's reserved parameters, compared exactly as Triton
    compares it: a request's ``Priority`` is its own parameter, which the model sees."""
    return name in RESERVED or name.startswith(PREFIX)


def model_parameters(parameters: Mapping[str, Any]) -> dict[str, Any]:
    """The parameters of a request that its model sees (and its ensemble's steps carry)."""
    return {k: v for k, v in parameters.items() if not is_reserved(k)}
