"""Which request parameters a model sees: Triton gives a model (``request.parameters()`` in
a Python model) the request's own parameters, not those it reserves for itself (sequence
ids and flags, priority, timeout, ``binary_data_output``, ``headers``, and every name
starting with ``triton_``), and an ensemble passes them on to each of its steps."""

from __future__ import annotations

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


def is_reserved(name: str) -> bool:
    key = name.lower()
    return key in RESERVED or key.startswith(PREFIX)


def model_parameters(parameters: Mapping[str, Any]) -> dict[str, Any]:
    """The parameters of a request that its model sees (and its ensemble's steps carry)."""
    return {k: v for k, v in parameters.items() if not is_reserved(k)}
