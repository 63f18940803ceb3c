"""What a request to a sequence model says about its sequence, and where it goes.

Triton's request parameters ``sequence_id`` (a non-zero unsigned integer or a non-empty
string), ``sequence_start`` and ``sequence_end`` (booleans) name the sequence; every
request of one sequence goes to the same instance (its *slot*), chosen by a hash of the id
that every gateway computes alike, so that one worker holds the sequence's state and
computes its requests in order.
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


def sequence_of(parameters: Mapping[str, Any], model: str) -> SequenceRef:
    """The sequence a request to ``model`` belongs to; Triton's errors when it names none."""
    raw = parameters.get("sequence_id", 0)
    if isinstance(raw, bool) or not isinstance(raw, int | str):
        raise InvalidInput("parameter 'sequence_id' must be an unsigned integer or a string")
    if isinstance(raw, int) and not 0 <= raw <= _MAX_UINT64:
        raise InvalidInput("parameter 'sequence_id' must be an unsigned 64-bit integer")
    if isinstance(raw, str) and len(raw) > MAX_ID_CHARS:
        raise InvalidInput(f"parameter 'sequence_id' is longer than {MAX_ID_CHARS} characters")
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
