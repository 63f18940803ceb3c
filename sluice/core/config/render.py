"""Triton's ``/config`` JSON rendering of a ModelConfig message.

proto3 JSON writes 64-bit integers as strings; Triton converts them back to
numbers before answering, and so do we, walking the descriptor alongside the
dict so that only 64-bit integer fields are touched.
"""

from __future__ import annotations

from typing import Any

from google.protobuf import json_format
from google.protobuf.descriptor import Descriptor, FieldDescriptor

_INT64_TYPES = frozenset(
    {
        FieldDescriptor.TYPE_INT64,
        FieldDescriptor.TYPE_UINT64,
        FieldDescriptor.TYPE_SINT64,
        FieldDescriptor.TYPE_FIXED64,
        FieldDescriptor.TYPE_SFIXED64,
    }
)


def render_config(msg: Any) -> dict[str, Any]:
    """The JSON-ready dict Triton returns from ``/v2/models/<name>/config``."""
    data: dict[str, Any] = json_format.MessageToDict(
        msg,
        preserving_proto_field_name=True,
        always_print_fields_with_no_presence=True,
    )
    _fix_message(msg.DESCRIPTOR, data)
    return data


def _fix_message(descriptor: Descriptor, data: dict[str, Any]) -> None:
    for name, value in data.items():
        fd = descriptor.fields_by_name.get(name)
        if fd is not None:
            data[name] = _fix_field(fd, value)


def _fix_field(fd: FieldDescriptor, value: Any) -> Any:
    message_type = fd.message_type
    if message_type is not None and message_type.GetOptions().map_entry:
        value_fd = message_type.fields_by_name["value"]
        return {key: _fix_scalar_or_message(value_fd, item) for key, item in value.items()}
    if isinstance(value, list):
        return [_fix_scalar_or_message(fd, item) for item in value]
    return _fix_scalar_or_message(fd, value)


def _fix_scalar_or_message(fd: FieldDescriptor, value: Any) -> Any:
    if fd.message_type is not None and isinstance(value, dict):
        _fix_message(fd.message_type, value)
        return value
    if fd.type in _INT64_TYPES and isinstance(value, str):
        return int(value)
    return value
