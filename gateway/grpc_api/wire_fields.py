"""The top-level fields of an encoded protobuf message, walked without decoding it (and a
varint written, for the fields written by hand).

Each field is skipped, not read: a length-delimited one costs one varint whatever its
length, so a caller that stops after N fields has done N steps of work whatever the
message's size (:mod:`.entry_counts`, :mod:`.wire_id`). The walk ends quietly at the first
malformed byte: what is wrong with a message is the decoder's to say.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

LENGTH_DELIMITED = 2


class Field(NamedTuple):
    number: int
    wire_type: int
    start: int
    """Where its value starts (after a length-delimited field's length)."""
    end: int
    """Where its value ends (past the message's end when the message is cut short)."""


def top_level_fields(message: bytes) -> Iterator[Field]:
    """The fields of ``message``, in order."""
    position, end = 0, len(message)
    while position < end:
        key, position = _varint(message, position)
        if key is None:
            return
        number, wire_type = key >> 3, key & 7
        start = position
        if wire_type == 0:
            _, position = _varint(message, position)
            if position < 0:
                return
        elif wire_type == 1:
            position += 8
        elif wire_type == 5:
            position += 4
        elif wire_type == LENGTH_DELIMITED:
            length, start = _varint(message, position)
            if length is None:
                return
            position = start + length
        else:
            return
        yield Field(number, wire_type, start, position)


def varint(value: int) -> bytes:
    """``value`` (not negative) as a protobuf varint."""
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


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
