"""Triton's ``--http-header-forward-pattern`` and ``--grpc-header-forward-pattern``: the
request headers (HTTP) or metadata (gRPC) whose names match a regular expression become
string parameters of each inference request, which the model reads as it reads any other
(``request.parameters()`` in a Triton Python model).

As in Triton, the pattern matches anywhere in the name and ignores case unless it starts
with ``(?-i)``. The ``Authorization`` header (the caller's API key) is never forwarded. A
forwarded name that is one of Triton's reserved parameters is refused with 400, and a
forwarded header replaces a request parameter of the same name.
"""

from __future__ import annotations

from collections.abc import Iterable
from contextvars import ContextVar
from typing import Any

from sluice.core.errors import InvalidInput
from sluice.core.request_parameters import ForwardPattern, is_reserved

Forwarded = tuple[tuple[str, str], ...]

FORWARDED: ContextVar[Forwarded] = ContextVar("sluice_forwarded_headers", default=())
"""The current request's forwarded headers (set by the HTTP edge or the gRPC handler)."""

_NEVER = frozenset({"authorization"})


def matching(pattern: ForwardPattern, headers: Iterable[tuple[str, str]]) -> Forwarded:
    """The headers ``pattern`` forwards, in order (the first of a repeated name)."""
    seen: dict[str, str] = {}
    for name, value in headers:
        if name.lower() not in _NEVER and name not in seen and pattern.search(name):
            seen[name] = value
    return tuple(seen.items())


def add_forwarded(parameters: dict[str, Any], forwarded: Forwarded) -> None:
    """Put the forwarded headers into a request's ``parameters`` (InvalidInput for a
    reserved name, in any case: header names are case-insensitive)."""
    for name, value in forwarded:
        if is_reserved(name.lower()):
            raise InvalidInput(
                f"parameter '{name}' from a forwarded header is reserved for Triton usage"
            )
        parameters[name] = value
