"""A ModelInferRequest's top-level entries counted before the message is decoded.

Decoding makes an object of every entry of a repeated field: an empty ``inputs`` entry is
2 bytes on the wire and about 80 once decoded, so a message of nothing but empty entries
decodes into some 40 times its size (GiBs for one message at the default receive limit)
before any check could look at it. Its top-level fields are walked first, each
length-delimited one skipped, not read: a message with more ``inputs`` or
``raw_input_contents`` than a request may have inputs, more ``parameters`` than it may
have, more ``outputs`` than :data:`MAX_OUTPUTS`, or more fields than all of those together
is refused after at most that many steps, whatever its size. What is malformed is left to
the decoder to say.
"""

from __future__ import annotations

from sluice.core.errors import InvalidInput
from sluice.gateway.inference.request import RequestLimits

MAX_OUTPUTS = 4096
"""Outputs a request may name (each at most once, so more than any model has)."""

_PARAMETERS, _INPUTS, _OUTPUTS, _RAW = 4, 5, 6, 7
_SINGULAR_FIELDS = 16
"""Room for the singular fields (model name, version, id), even when repeated."""


def check_entry_counts(message: bytes, limits: RequestLimits) -> None:
    """Raise :class:`InvalidInput` when ``message`` holds more entries than a request may."""
    bounds = {
        _PARAMETERS: ("parameters", limits.max_parameters),
        _INPUTS: ("inputs", limits.max_inputs),
        _OUTPUTS: ("outputs", MAX_OUTPUTS),
        _RAW: ("raw_input_contents", limits.max_inputs),
    }
    counts = dict.fromkeys(bounds, 0)
    most_fields = sum(bound for _, bound in bounds.values()) + _SINGULAR_FIELDS
    position, end = 0, len(message)
    for _ in range(most_fields):
        if position >= end:
            return
        key, position = _varint(message, position)
        if key is None:
            return
        number, wire_type = key >> 3, key & 7
        if wire_type == 0:
            _, position = _varint(message, position)
            if position < 0:
                return
        elif wire_type == 1:
            position += 8
        elif wire_type == 5:
            position += 4
        elif wire_type == 2:
            length, position = _varint(message, position)
            if length is None:
                return
            position += length
        else:
            return
        if number in counts:
            counts[number] += 1
            name, bound = bounds[number]
            if counts[number] > bound:
                raise InvalidInput(f"request '{name}' has more entries than the limit of {bound}")
    if position < end:
        raise InvalidInput(
            f"the ModelInferRequest has more than {most_fields} fields, more than any request needs"
        )


def _varint(data: bytes, position: int) -> tuple[int | None, int]:
    """The varint at ``position`` and the position after it ((None, -1) if malformed)."""
    value = shift = 0
    end = len(data)
    while position < end and shift < 64:
        byte = data[position]
        position += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, position
        shift += 7
    return None, -1
