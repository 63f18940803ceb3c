"""The ``id`` of an encoded ModelInferRequest, found without decoding the message.

A stream request refused before it is decoded (no room for its bytes) is still answered
with its id, so that the client can tell which request failed. Only the first few
top-level fields are looked at (serializers write ``id``, field 3, after the model's name
and version), and a length-delimited field is skipped, not read: constant work whatever
the message's size.
"""

from __future__ import annotations

from sluice.gateway.grpc_api.wire_fields import LENGTH_DELIMITED, top_level_fields

_ID_FIELD = 3
_FIELDS_LOOKED_AT = 8
_MAX_ID_BYTES = 1024


def request_id_of(message: bytes) -> str:
    """The request's ``id``, or "" when it has none or the message is malformed."""
    for index, field in enumerate(top_level_fields(message)):
        if index == _FIELDS_LOOKED_AT:
            break
        if field.number == _ID_FIELD and field.wire_type == LENGTH_DELIMITED:
            if field.end - field.start > _MAX_ID_BYTES:
                break
            return message[field.start : field.end].decode("utf-8", "replace")
    return ""
