"""What a request to a sequence model says about its sequence, and where it goes.

Triton's request parameters ``sequence_id`` (a non-zero unsigned integer or a non-empty
string), ``sequence_start`` and ``sequence_end`` (booleans) name the sequence; every
request of one sequence goes to the same instance (its *slot*), chosen by a hash of the id
that every gateway computes alike, so that one worker holds the sequence's state and
computes its requests in order.

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

from sluice.core.errors import InvalidInput

MAX_ID_CHARS = 256
"""Longest string correlation id accepted."""
_MAX_UINT64 = (1 << 64) - 1
_MAX_INT64 = (1 << 63) - 1

FLAG_SEQUENCE_START = 1
"""Triton's ``TRITONSERVER_REQUEST_FLAG_SEQUENCE_START``."""
FLAG_SEQUENCE_END = 2
"""Triton's ``TRITONSERVER_REQUEST_FLAG_SEQUENCE_END``."""


@dataclass(frozen=True, slots=True)
class SequenceRef:
    id: int | str
    start: bool
    end: bool

    @property
    def key(self) -> str:
        """A fixed-length name of the id for Redis keys (ids are client text)."""
        text = f"u{self.id}" if isinstance(self.id, int) else f"s{self.id}"
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


def sequence_of(parameters: Mapping[str, Any], model: str) -> SequenceRef:
    """The sequence a request to ``model`` belongs to; Triton's errors when it names none."""
    raw = _sequence_id(parameters)
    if raw == 0 or raw == "":
        raise InvalidInput(
            f"inference request to model '{model}' must specify a non-zero or non-empty "
            "correlation ID"
        )
    return SequenceRef(raw, _flag(parameters, "sequence_start"), _flag(parameters, "sequence_end"))


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
