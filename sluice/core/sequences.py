"""What a request to a sequence model says about its sequence, and where it goes.

Triton's request parameters ``sequence_id`` (a non-zero unsigned integer or a non-empty
string), ``sequence_start`` and ``sequence_end`` (booleans) name the sequence; every
request of one sequence goes to the same instance (its *slot*), chosen by a hash of the id
that every gateway computes alike, so that one worker holds the sequence's state and
computes its requests in order. A sequence is its tenant's: two tenants that use one id
have two sequences (:attr:`SequenceRef.key`).

Any request may carry these parameters, sequence model or not; Triton's core records them as
the request's correlation id and flags (:func:`request_sequence`), which a Python model
reads (``request.correlation_id()``, ``request.flags()``) and an ensemble's responses
repeat (:func:`ensemble_response_parameters`).
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sluice.core.config import SequenceBatching
from sluice.core.errors import InvalidInput

MAX_ID_CHARS = 256
"""Longest string correlation id accepted."""
_MAX_UINT64 = (1 << 64) - 1
_MAX_INT64 = (1 << 63) - 1

FLAG_SEQUENCE_START = 1
"""Triton's ``TRITONSERVER_REQUEST_FLAG_SEQUENCE_START``."""
FLAG_SEQUENCE_END = 2
"""Triton's ``TRITONSERVER_REQUEST_FLAG_SEQUENCE_END``."""


_CORRID_BITS = {"UINT64": 64, "INT64": 64, "UINT32": 32, "INT32": 32}
"""The integer types a CORRID control input may have, by width."""


@dataclass(frozen=True, slots=True)
class SequenceRef:
    id: int | str
    start: bool
    end: bool
    tenant: str = ""
    """Whose sequence it is (the tenant as entries name it; "": the anonymous tenant)."""

    @property
    def key(self) -> str:
        """A fixed-length name of the sequence for Redis keys and the worker's book (ids are
        client text). It names the tenant too: a request naming the id of another tenant's
        sequence must not join it, read its state or end it."""
        text = f"u{self.id}" if isinstance(self.id, int) else f"s{self.id}"
        if self.tenant:  # (length-prefixed: no tenant and id can spell another pair)
            text = f"{len(self.tenant)}:{self.tenant}{text}"
        return hashlib.sha1(text.encode(), usedforsecurity=False).hexdigest()

    def slot(self, slots: int) -> int:
        text = f"u{self.id}" if isinstance(self.id, int) else f"s{self.id}"
        return zlib.crc32(text.encode()) % max(1, slots)


def _flag(parameters: Mapping[str, Any], name: str) -> bool:
    value = parameters.get(name, False)
    if not isinstance(value, bool):
        raise InvalidInput(f"parameter '{name}' must be a boolean")
    return value


def _sequence_id(parameters: Mapping[str, Any]) -> int | str:
    """The request's ``sequence_id`` (0 when it gives none), checked."""
    raw = parameters.get("sequence_id", 0)
    if isinstance(raw, bool) or not isinstance(raw, int | str):
        raise InvalidInput("parameter 'sequence_id' must be an unsigned integer or a string")
    if isinstance(raw, int) and not 0 <= raw <= _MAX_UINT64:
        raise InvalidInput("parameter 'sequence_id' must be an unsigned 64-bit integer")
    if isinstance(raw, str) and len(raw) > MAX_ID_CHARS:
        raise InvalidInput(f"parameter 'sequence_id' is longer than {MAX_ID_CHARS} characters")
    return raw


def request_sequence(parameters: Mapping[str, Any]) -> tuple[int | str, int]:
    """The correlation id and flags (:data:`FLAG_SEQUENCE_START`, :data:`FLAG_SEQUENCE_END`)
    of any request, as Triton's core records them: 0 and 0 when it names no sequence.
    Raises :class:`InvalidInput` naming a parameter of the wrong type."""
    flags = FLAG_SEQUENCE_START if _flag(parameters, "sequence_start") else 0
    if _flag(parameters, "sequence_end"):
        flags |= FLAG_SEQUENCE_END
    return _sequence_id(parameters), flags


def ensemble_response_parameters(parameters: Mapping[str, Any]) -> dict[str, int | str | bool]:
    """The parameters Triton's ensemble puts on each of its responses (whatever the
    protocol, sequence or not): the request's ``sequence_id`` (a string id as a string; an
    integer one as a signed 64-bit integer, as Triton writes it), ``sequence_start`` and
    ``sequence_end``. Clients streaming a sequence through an ensemble read its flags there."""
    correlation_id, flags = request_sequence(parameters)
    if isinstance(correlation_id, int) and correlation_id > _MAX_INT64:
        correlation_id -= 1 << 64
    return {
        "sequence_id": correlation_id,
        "sequence_start": bool(flags & FLAG_SEQUENCE_START),
        "sequence_end": bool(flags & FLAG_SEQUENCE_END),
    }


def sequence_of(parameters: Mapping[str, Any], model: str, tenant: str = "") -> SequenceRef:
    """The sequence of ``tenant`` (as entries name it) a request to ``model`` belongs to;
    Triton's errors when it names none."""
    raw = _sequence_id(parameters)
    if raw == 0 or raw == "":
        raise InvalidInput(
            f"inference request to model '{model}' must specify a non-zero or non-empty "
            "correlation ID"
        )
    start, end = _flag(parameters, "sequence_start"), _flag(parameters, "sequence_end")
    return SequenceRef(raw, start, end, tenant)


def check_corrid(ref: SequenceRef, batching: SequenceBatching, model: str) -> None:
    """Refuse an id the model's CORRID control input cannot hold: a string for an integer
    type, or an integer wider than a 32-bit type. (Triton copies the id's low bytes, or
    leaves the input unset for a string: distinct sequences would reach the model under one
    id.) An id that fits the type's width is taken as its bits, as Triton does
    (:func:`corrid_value`)."""
    control = batching.control("CORRID")
    bits = _CORRID_BITS.get(control.datatype) if control is not None else None
    if bits is None:
        return
    if isinstance(ref.id, str):
        reason = "which takes integer correlation IDs, not strings"
    elif ref.id >> bits:
        reason = "which cannot hold the correlation ID"
    else:
        return
    assert control is not None
    raise InvalidInput(
        f"inference request for sequence {ref.id} to model '{model}': its CORRID control "
        f"input is {control.datatype}, {reason}"
    )


def corrid_value(correlation_id: int | str, datatype: str) -> int | bytes:
    """The value of a CORRID control input of ``datatype`` for an id that
    :func:`check_corrid` let through: the text of an integer id for a string input (as
    bytes), the id's bits read as the input's integer type otherwise."""
    if datatype == "BYTES":
        return str(correlation_id).encode()
    assert isinstance(correlation_id, int)
    bits = _CORRID_BITS[datatype]
    if datatype.startswith("INT") and correlation_id >> (bits - 1):
        return correlation_id - (1 << bits)
    return correlation_id


def batch_size_problem(model: str) -> InvalidInput:
    return InvalidInput(
        f"inference request to model '{model}' must specify batch-size 1 due to requirements "
        "of sequence batcher"
    )


def start_missing(ref: SequenceRef, model: str) -> InvalidInput:
    return InvalidInput(
        f"inference request for sequence {ref.id} to model '{model}' must specify the START "
        "flag on the first request of the sequence"
    )
