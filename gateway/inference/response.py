"""Encode a KServe v2 / Triton HTTP inference response.

Outputs arrive in Triton's binary layout. Each goes either as JSON ``data``
(flat, row-major) or as binary bytes appended after the JSON header, announced
by ``parameters.binary_data_size``. An output written into a client's shared
memory region carries no data, only ``parameters.shared_memory_region`` and
``shared_memory_byte_size`` (the bytes written). When no output contributes bytes
the body is pure JSON and no ``Inference-Header-Content-Length`` is sent, as Triton does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

from sluice.core.datatypes import BYTES, ELEMENT_SIZE, deserialize_bytes, element_count, to_numpy
from sluice.core.errors import InferenceFailed, InvalidInput

_DUMPS_OPTIONS = orjson.OPT_SERIALIZE_NUMPY


@dataclass(slots=True)
class OutputTensor:
    name: str
    datatype: str
    shape: tuple[int, ...]
    data: bytes | memoryview  # binary layout
    region: str = ""  # the client's shared memory region holding the bytes instead
    region_bytes: int = 0  # bytes written there


def encode_infer_response(
    *,
    model_name: str,
    model_version: str,
    request_id: str,
    outputs: Sequence[OutputTensor],
    binary: Sequence[bool],
    json_asked: Sequence[bool] | None = None,
    parameters: Mapping[str, bool | int | str] | None = None,
) -> tuple[bytes, int | None]:
    """The response body and the JSON header length (None when the body is pure JSON).
    ``parameters``: the response's own (an ensemble's sequence flags), if any.

    ``binary[i]`` asks for ``outputs[i]`` as binary data. An output asked for as
    JSON still goes binary when JSON cannot carry it exactly (BYTES elements that
    are not UTF-8, non-finite floats); tritonclient reads either form. But BYTES that are
    not UTF-8 in an output whose JSON form was asked for in so many words (``json_asked[i]``:
    ``binary_data`` false) are a 400 with the text Triton's clients give then (Triton sends
    the bytes as they are in a JSON string, which its clients cannot decode).
    """
    if len(binary) != len(outputs):
        raise ValueError(f"{len(outputs)} outputs but {len(binary)} binary flags")
    json_flags = json_asked if json_asked is not None else [False] * len(outputs)
    if len(json_flags) != len(outputs):
        raise ValueError(f"{len(outputs)} outputs but {len(json_flags)} JSON flags")
    entries: list[dict[str, Any]] = []
    buffers: list[bytes | memoryview] = []
    for output, want_binary, json_only in zip(outputs, binary, json_flags, strict=True):
        nbytes = checked_nbytes(output)
        entry: dict[str, Any] = {
            "name": output.name,
            "datatype": output.datatype,
            "shape": list(output.shape),
        }
        if output.region:
            entry["parameters"] = {
                "shared_memory_region": output.region,
                "shared_memory_byte_size": nbytes,
            }
            entries.append(entry)
            continue
        data = None if want_binary else _json_data(output, json_only)
        if data is None:
            entry["parameters"] = {"binary_data_size": nbytes}
            if nbytes:
                buffers.append(output.data)
        else:
            entry["data"] = data
        entries.append(entry)

    document: dict[str, Any] = {"model_name": model_name, "model_version": model_version}
    if request_id:
        document["id"] = request_id
    if parameters:
        document["parameters"] = dict(parameters)
    document["outputs"] = entries
    header = orjson.dumps(document, option=_DUMPS_OPTIONS)
    if not buffers:
        return header, None
    return b"".join((header, *buffers)), len(header)


def encode_error(message: str) -> bytes:
    """The error body every endpoint sends: ``{"error": message}``."""
    return orjson.dumps({"error": message})


def checked_nbytes(output: OutputTensor) -> int:
    """Byte length of the output's buffer, checked against its shape (fixed width)."""
    nbytes = output.region_bytes if output.region else memoryview(output.data).nbytes
    element_size = ELEMENT_SIZE.get(output.datatype)
    if element_size is not None:
        expected = element_size * element_count(output.shape)
        if nbytes != expected:
            raise InferenceFailed(
                f"output '{output.name}': {nbytes} bytes do not fit shape "
                f"{list(output.shape)} of {output.datatype} ({expected} bytes)"
            )
    elif output.datatype != BYTES:
        raise InferenceFailed(f"output '{output.name}': unknown datatype {output.datatype}")
    return nbytes


NOT_UTF8 = (
    "Failed to encode using UTF-8. Please use binary_data=True, if you want to pass a byte array."
)
"""tritonclient's text for a JSON answer whose BYTES are not UTF-8."""


def _json_data(output: OutputTensor, json_only: bool = False) -> Any:
    """Flat JSON-ready data (list or numpy array), or None if JSON can't carry it (a 400
    for BYTES that are not UTF-8 when ``json_only``)."""
    if output.datatype == BYTES:
        try:
            elements = deserialize_bytes(output.data)
        except InvalidInput as exc:
            raise InferenceFailed(f"output '{output.name}': {exc.message}") from None
        if len(elements) != element_count(output.shape):
            raise InferenceFailed(
                f"output '{output.name}': {len(elements)} BYTES elements do not fit shape "
                f"{list(output.shape)}"
            )
        try:
            return [element.decode() for element in elements]
        except UnicodeDecodeError:
            if json_only:
                raise _not_utf8(output.name, elements) from None
            return None
    array = to_numpy(output.datatype, (-1,), output.data)
    if array.dtype.kind == "f" and not np.isfinite(array).all():
        return None  # JSON has no NaN / Infinity
    if not array.dtype.isnative:  # orjson serializes native-endian arrays only
        return array.tolist()
    return array


def _not_utf8(name: str, elements: Sequence[bytes]) -> InvalidInput:
    """tritonclient's text, then which element of the output is not UTF-8 and why."""
    for index, element in enumerate(elements):
        try:
            element.decode()
        except UnicodeDecodeError as exc:
            return InvalidInput(
                f"{NOT_UTF8} UnicodeError: output '{name}' element {index}: {exc}; ask for it "
                "with parameters.binary_data true"
            )
    raise AssertionError("every element is UTF-8")  # pragma: no cover
