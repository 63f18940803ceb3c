"""A numeric typed ``contents`` field in Triton's binary layout, read from its packed wire
form instead of value by value.

Reading a decoded repeated field makes a Python object of every value (~30 ns each, so
~2 ms for a 64 KiB field of one-byte integers). Its packed encoding, which the decoded
``InferTensorContents`` gives back at C speed, already is the layout for the fixed-width
fields (``fp32_contents``, ``fp64_contents``: little-endian values one after the other),
and for the varint fields when every value takes one byte (``bool_contents``, and integers
from 0 to 127): each byte is then its value. Any other field (a varint of two bytes or
more) is read value by value, as before (a varint field whose first or last value takes
more than a byte without encoding it first). The encoding is re-made by the decoder,
whatever the client sent (packed or not, varints padded or not), and its size is checked
against the field's count before it is trusted.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from google.protobuf.message import Message

from .wire_fields import LENGTH_DELIMITED, top_level_fields

_ONE_BYTE = 0x80
"""Varints below this take one byte."""


def contents_bytes(
    contents: Message, field: str, numpy_type: Any, narrowed: Any
) -> bytes | memoryview:
    """The values of ``contents``'s repeated numeric ``field`` (not empty) as little-endian
    ``numpy_type``, each cut to ``narrowed`` when that is given (the low bytes of each value,
    as Triton takes ``int_contents`` for an INT8 / INT16 tensor)."""
    values: Any = getattr(contents, field)
    count = len(values)
    dtype = np.dtype(numpy_type)
    fixed_width = dtype.kind == "f"
    packed = _packed(contents, field) if fixed_width or _may_be_bytes(values) else None
    array: np.ndarray[Any, Any]
    if packed is not None and fixed_width and len(packed) == count * dtype.itemsize:
        return packed  # (floats are never narrowed)
    if packed is not None and not fixed_width and len(packed) == count:
        array = np.frombuffer(packed, np.uint8)  # (count varints in count bytes: all < 128)
    else:
        array = np.fromiter(values, dtype=dtype, count=count)
    array = array.astype(narrowed if narrowed is not None else dtype, copy=False)
    return array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes()


def _may_be_bytes(values: Any) -> bool:
    """Whether a varint field may hold nothing but values of one byte, told from its first
    and last: encoding one whose values are larger is work for nothing (~0.1 of reading it
    value by value)."""
    first: int = values[0]
    last: int = values[-1]
    return 0 <= first < _ONE_BYTE and 0 <= last < _ONE_BYTE


def _packed(contents: Message, field: str) -> memoryview | None:
    """The packed payload of ``field`` in ``contents``'s encoding (None when the field is
    not there as one packed entry)."""
    number = contents.DESCRIPTOR.fields_by_name[field].number
    encoded = contents.SerializeToString()
    found: memoryview | None = None
    for entry in top_level_fields(encoded):  # (one entry per non-empty field: 8 at most)
        if entry.number != number:
            continue
        if found is not None or entry.wire_type != LENGTH_DELIMITED:
            return None
        found = memoryview(encoded)[entry.start : entry.end]
    return found
