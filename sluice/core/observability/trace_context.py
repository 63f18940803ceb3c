"""W3C Trace Context: the ``traceparent`` and ``tracestate`` headers, checked strictly.

A ``traceparent`` that does not follow the specification is ignored, as the specification
says (the receiver then starts a new trace); a ``tracestate`` that does not is dropped,
keeping the ``traceparent``. Pure string work: no OpenTelemetry here, so the gateway and
the workers can carry a client's trace context whether or not they export spans.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")
_V00_LENGTH = 55
_ZERO_TRACE = "0" * 32
_ZERO_PARENT = "0" * 16

_KEY = re.compile(
    r"[a-z][a-z0-9_\-*/]{0,255}"  # simple-key
    r"|[a-z0-9][a-z0-9_\-*/]{0,240}@[a-z][a-z0-9_\-*/]{0,13}"  # multi-tenant-key
)
_VALUE = re.compile(r"[\x20-\x2b\x2d-\x3c\x3e-\x7e]{0,255}[\x21-\x2b\x2d-\x3c\x3e-\x7e]")
_MAX_MEMBERS = 32
MAX_TRACESTATE_LENGTH = 512
"""The length every vendor must propagate; longer ``tracestate`` values are dropped."""


@dataclass(frozen=True, slots=True)
class TraceParent:
    """A valid trace context: ``header`` is the ``traceparent`` in version 00 form."""

    trace_id: str
    """32 lowercase hex digits, not all zero."""
    parent_id: str
    """16 lowercase hex digits, not all zero: the span that sent the request."""
    flags: str
    """2 lowercase hex digits; bit 0 is "sampled"."""
    state: str = ""
    """The ``tracestate`` that came with it, when valid; else empty."""

    @property
    def header(self) -> str:
        return f"00-{self.trace_id}-{self.parent_id}-{self.flags}"

    @property
    def sampled(self) -> bool:
        return bool(int(self.flags, 16) & 1)


def parse_traceparent(value: str, tracestate: str | None = None) -> TraceParent | None:
    """The trace context of ``value``, or None when it is not a valid ``traceparent``.

    Version 00 must be exactly 55 characters; a later version may carry more fields after
    a ``-`` (the first four are read, as the specification asks); version ``ff`` is invalid.
    """
    match = _TRACEPARENT.match(value)
    if match is None:
        return None
    version, trace_id, parent_id, flags = match.groups()
    if version == "ff" or trace_id == _ZERO_TRACE or parent_id == _ZERO_PARENT:
        return None
    if len(value) != _V00_LENGTH and (version == "00" or value[_V00_LENGTH] != "-"):
        return None
    state = tracestate if tracestate is not None and valid_tracestate(tracestate) else ""
    return TraceParent(trace_id, parent_id, flags, state)


def valid_tracestate(value: str) -> bool:
    """Whether ``value`` is a valid ``tracestate``: at most 32 ``key=value`` members (empty
    members allowed), keys and values as the specification defines them, no key twice."""
    if len(value) > MAX_TRACESTATE_LENGTH:
        return False
    keys: set[str] = set()
    for member in value.split(","):
        member = member.strip(" \t")
        if not member:
            continue
        key, equals, item = member.partition("=")
        if not equals or _KEY.fullmatch(key) is None or _VALUE.fullmatch(item) is None:
            return False
        if key in keys:
            return False
        keys.add(key)
    return len(keys) <= _MAX_MEMBERS


def format_traceparent(trace_id: int, span_id: int, flags: int) -> str:
    """The version 00 ``traceparent`` of a span."""
    return f"00-{trace_id:032x}-{span_id:016x}-{flags:02x}"
