"""The ``id`` of an encoded ModelInferRequest, found without decoding the message.

A stream request refused before it is decoded (no room for its bytes) is still answered
with its id, so that the client can tell which request failed. Only the first few
top-level fields are looked at (serializers write ``id``, field 3, after the model's name
and version), and a length-delimited field is skipped, not read: constant work whatever
the message's size.
"""

from __future__ import annotations

_ID_FIELD = 3
_FIELDS_LOOKED_AT = 8
_MAX_ID_BYTES = 1024


def request_id_of(message: bytes) -> str:
    """The request's ``id``, or "" when it has none or the message is malformed."""
    position = 0
    try:
        for _ in range(_FIELDS_LOOKED_AT):
            if position >= len(message):
                return ""
            key, position = _varint(message, position)
            number, wire_type = key >> 3, key & 7
            if wire_type == 0:
                _, position = _varint(message, position)
            elif wire_type == 1:
                position += 8
            elif wire_type == 5:
                position += 4
            elif wire_type == 2:
                length, position = _varint(message, position)
                if number == _ID_FIELD:
                    if length > _MAX_ID_BYTES:
                        return ""
                    return message[position : position + length].decode("utf-8", "replace")
                position += length
            else:
                return ""
    except IndexError:
        return ""
    return ""


def _varint(data: bytes, position: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[position]
        position += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, position
        shift += 7
        if shift > 63:
            raise IndexError("varint too long")
