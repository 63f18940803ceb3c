"""Which request parameters a model sees: Triton gives a model (``request.parameters()`` in
a Python model) the request's own parameters, not those it reserves for itself (sequence
ids and flags, priority, timeout, ``binary_data_output``, ``headers``, and every name
starting with ``triton_``), and an ensemble passes them on to each of its steps."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import re2

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


class ForwardPattern(Protocol):
    """A compiled header-forward pattern: finds a match anywhere in a header's name."""

    def search(self, text: str) -> object | None: ...


class PatternError(ValueError):
    """A header-forward pattern that RE2 cannot compile."""


def forward_pattern(text: str) -> ForwardPattern | None:
    """A header-forward pattern as Triton reads it (``--http-header-forward-pattern``):
    RE2's syntax, matched in linear time (a header name a client chose cannot make it
    backtrack), ignoring case unless the pattern turns that off (``(?-i)``); None when
    empty; :class:`PatternError` when RE2 cannot compile it (Python-only syntax such as
    look-arounds and back-references included, as Triton refuses it)."""
    if not text:
        return None
    options = re2.Options()
    options.case_sensitive = False
    options.log_errors = False
    try:
        pattern: ForwardPattern = re2.compile(text, options)
    except re2.error as exc:
        reason = exc.args[0] if exc.args else exc
        if isinstance(reason, bytes):
            reason = reason.decode("utf-8", "replace")
        raise PatternError(str(reason)) from None
    return pattern


def is_reserved(name: str) -> bool:
    """Whether ``name`` is one of Triton's reserved parameters, compared exactly as Triton
    compares it: a request's ``Priority`` is its own parameter, which the model sees."""
    return name in RESERVED or name.startswith(PREFIX)


def model_parameters(parameters: Mapping[str, Any]) -> dict[str, Any]:
    """The parameters of a request that its model sees (and its ensemble's steps carry)."""
    return {k: v for k, v in parameters.items() if not is_reserved(k)}
