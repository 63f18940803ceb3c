"""KServe v2 datatypes, their numpy equivalents and Triton config enum names.

Tensors travel between processes in Triton's binary tensor layout:
row-major, little-endian, native width; BOOL one byte; BYTES as a sequence of
(uint32 little-endian length, raw bytes) elements; BF16 as the upper two bytes
of each float32. Every conversion between that layout and numpy lives here.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from sluice.core.errors import InvalidInput

BYTES = "BYTES"
BF16 = "BF16"

# Protocol datatype -> numpy dtype (little-endian). BYTES maps to object, BF16 to
# float32 (numpy has no bfloat16; tritonclient does the same).
_NUMPY: dict[str, np.dtype[Any]] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype("<u1"),
    "UINT16": np.dtype("<u2"),
    "UINT32": np.dtype("<u4"),
    "UINT64": np.dtype("<u8"),
    "INT8": np.dtype("<i1"),
    "INT16": np.dtype("<i2"),
    "INT32": np.dtype("<i4"),
    "INT64": np.dtype("<i8"),
    "FP16": np.dtype("<f2"),
    "FP32": np.dtype("<f4"),
    "FP64": np.dtype("<f8"),
    BF16: np.dtype("<f4"),
    BYTES: np.dtype(np.object_),
}

# Bytes per element in the binary layout; BYTES is variable and absent.
ELEMENT_SIZE: dict[str, int] = {
    "BOOL": 1,
    "UINT8": 1,
    "UINT16": 2,
    "UINT32": 4,
    "UINT64": 8,
    "INT8": 1,
    "INT16": 2,
    "INT32": 4,
    "INT64": 8,
    "FP16": 2,
    "FP32": 4,
    "FP64": 8,
    BF16: 2,
}

DATATYPES: frozenset[str] = frozenset(_NUMPY)

_CONFIG_TO_PROTOCOL: dict[str, str] = {f"TYPE_{name}": name for name in ELEMENT_SIZE}
_CONFIG_TO_PROTOCOL["TYPE_STRING"] = BYTES
_PROTOCOL_TO_CONFIG: dict[str, str] = {v: k for k, v in _CONFIG_TO_PROTOCOL.items()}

_LENGTH = struct.Struct("<I")


def from_config_type(config_type: str) -> str:
    """``TYPE_FP32`` -> ``FP32``; ``TYPE_STRING`` -> ``BYTES``."""
    try:
        return _CONFIG_TO_PROTOCOL[config_type]
    except KeyError:
        raise ValueError(f"unsupported data_type {config_type!r}") from None


def to_config_type(datatype: str) -> str:
    """``FP32`` -> ``TYPE_FP32``; ``BYTES`` -> ``TYPE_STRING``."""
    return _PROTOCOL_TO_CONFIG[datatype]


def numpy_dtype(datatype: str) -> np.dtype[Any]:
    return _NUMPY[datatype]


def from_numpy_dtype(dtype: np.dtype[Any]) -> str:
    """The protocol datatype of a numpy dtype (object and string kinds are BYTES)."""
    if dtype.kind in "OSU":
        return BYTES
    for name, candidate in _NUMPY.items():
        if name != BF16 and candidate == dtype.newbyteorder("<"):
            return name
    raise ValueError(f"numpy dtype {dtype} has no protocol datatype")


def element_count(shape: Sequence[int]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


def byte_size(datatype: str, shape: Sequence[int]) -> int | None:
    """Bytes a fixed-width tensor takes in the binary layout; None for BYTES."""
    size = ELEMENT_SIZE.get(datatype)
    return None if size is None else size * element_count(shape)


def count_bytes_elements(buffer: bytes | memoryview) -> int:
    """Number of length-prefixed elements in a BYTES buffer; raises if malformed."""
    view = memoryview(buffer)
    offset, count, end = 0, 0, len(view)
    while offset < end:
        if offset + 4 > end:
            raise InvalidInput("BYTES data is truncated inside an element length prefix")
        (length,) = _LENGTH.unpack_from(view, offset)
        offset += 4 + length
        if offset > end:
            raise InvalidInput("BYTES data is truncated inside an element")
        count += 1
    return count


def serialize_bytes(elements: Iterable[Any]) -> bytes:
    """Length-prefix each element (bytes as is, str as UTF-8, other objects via str)."""
    parts: list[bytes] = []
    for element in elements:
        if isinstance(element, bytes | bytearray | memoryview):
            raw = bytes(element)
        elif isinstance(element, str):
            raw = element.encode()
        elif isinstance(element, np.bytes_):
            raw = bytes(element)
        else:
            raw = str(element).encode()
        parts.append(_LENGTH.pack(len(raw)))
        parts.append(raw)
    return b"".join(parts)


def deserialize_bytes(buffer: bytes | memoryview) -> list[bytes]:
    view = memoryview(buffer)
    offset, end = 0, len(view)
    elements: list[bytes] = []
    while offset < end:
        if offset + 4 > end:
            raise InvalidInput("BYTES data is truncated inside an element length prefix")
        (length,) = _LENGTH.unpack_from(view, offset)
        offset += 4
        if offset + length > end:
            raise InvalidInput("BYTES data is truncated inside an element")
        elements.append(bytes(view[offset : offset + length]))
        offset += length
    return elements


def to_numpy(datatype: str, shape: Sequence[int], buffer: bytes | memoryview) -> np.ndarray:
    """A numpy view (zero-copy for fixed-width types) over a binary-layout buffer."""
    if datatype == BYTES:
        elements = deserialize_bytes(buffer)
        array = np.empty(len(elements), dtype=np.object_)
        array[:] = elements
        return array.reshape(shape)
    if datatype == BF16:
        upper = np.frombuffer(buffer, dtype="<u2").astype("<u4") << 16
        return upper.view("<f4").reshape(shape)
    return np.frombuffer(buffer, dtype=_NUMPY[datatype]).reshape(shape)


def to_buffer(datatype: str, array: np.ndarray) -> bytes | memoryview:
    """The binary layout of an array (no copy when it is already contiguous)."""
    if datatype == BYTES:
        return serialize_bytes(array.reshape(-1))
    if datatype == BF16:
        as_f32 = np.ascontiguousarray(array, dtype="<f4")
        return (as_f32.view("<u4") >> 16).astype("<u2").tobytes()
    target = _NUMPY[datatype]
    if array.dtype != target:
        array = array.astype(target)
    contiguous = np.ascontiguousarray(array)
    return memoryview(contiguous).cast("B") if contiguous.size else b""  # type: ignore[arg-type]
