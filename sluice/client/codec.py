"""Tensors to and from KServe v2 bodies: JSON ``data`` and Triton's binary tensor extension.

A body is a JSON header, optionally followed by the raw bytes of the tensors that say
``parameters.binary_data_size``, in the header's order; ``Inference-Header-Content-Length``
gives the header's length. The bytes are Triton's binary layout (:mod:`sluice.core.datatypes`):
little-endian, BOOL one byte, BYTES as length-prefixed elements.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from sluice.client.errors import MalformedResponse
from sluice.core.datatypes import (
    BYTES,
    ELEMENT_SIZE,
    element_count,
    from_numpy_dtype,
    numpy_dtype,
    to_buffer,
    to_numpy,
)
from sluice.core.errors import InvalidInput

HEADER_LENGTH = "Inference-Header-Content-Length"
BINARY_SIZE = "binary_data_size"


@dataclass(frozen=True, slots=True)
class Body:
    """An encoded request body; ``json_length`` is None for a pure JSON body."""

    content: bytes
    json_length: int | None

    def headers(self) -> dict[str, str]:
        if self.json_length is None:
            return {"Content-Type": "application/json"}
        return {
            "Content-Type": "application/octet-stream",
            HEADER_LENGTH: str(self.json_length),
        }


def _dumps(document: Any) -> bytes:
    return json.dumps(document, separators=(",", ":"), ensure_ascii=False).encode()


def as_tensor(name: str, value: npt.ArrayLike) -> tuple[str, np.ndarray]:
    """The protocol datatype and numpy array of an input (str and bytes arrays are BYTES)."""
    array = np.asarray(value)
    try:
        datatype = from_numpy_dtype(array.dtype)
    except ValueError:
        raise InvalidInput(
            f"input '{name}': numpy dtype {array.dtype} has no KServe v2 datatype"
        ) from None
    return datatype, array


def _json_data(datatype: str, array: np.ndarray) -> list[Any] | None:
    """The flat JSON ``data`` of a tensor, or None when JSON cannot carry it exactly (BYTES
    that are not UTF-8, NaN and infinities)."""
    flat = array.reshape(-1)
    if datatype == BYTES:
        values: list[Any] = []
        for element in flat:
            if isinstance(element, str):
                values.append(element)
                continue
            raw = bytes(element) if isinstance(element, bytes | bytearray | memoryview) else None
            if raw is None:
                values.append(str(element))
                continue
            try:
                values.append(raw.decode())
            except UnicodeDecodeError:
                return None
        return values
    if flat.dtype.kind == "f" and not np.isfinite(flat).all():
        return None
    data: list[Any] = flat.tolist()
    return data


def encode_tensor(
    name: str, value: npt.ArrayLike, binary: bool
) -> tuple[dict[str, Any], bytes | memoryview | None]:
    """An input's header entry and its bytes (None: the data is in the entry as JSON)."""
    datatype, array = as_tensor(name, value)
    entry: dict[str, Any] = {"name": name, "shape": list(array.shape), "datatype": datatype}
    if not binary:
        data = _json_data(datatype, array)
        if data is not None:
            entry["data"] = data
            return entry, None
    raw = to_buffer(datatype, array)
    entry["parameters"] = {BINARY_SIZE: memoryview(raw).nbytes}
    return entry, raw


def encode_request(
    inputs: Mapping[str, npt.ArrayLike],
    *,
    outputs: Sequence[str] | None = None,
    parameters: Mapping[str, Any] | None = None,
    request_id: str | None = None,
    binary: bool = True,
) -> Body:
    """An inference request body.

    ``binary``: inputs go as raw bytes after the header and every output is asked for as
    binary (``binary_data_output`` when no output is named). Otherwise inputs go as JSON
    ``data``, except those JSON cannot carry exactly, which go binary as the server's
    answers do."""
    document: dict[str, Any] = {}
    if request_id is not None:
        document["id"] = request_id
    entries: list[dict[str, Any]] = []
    buffers: list[bytes | memoryview] = []
    for name, value in inputs.items():
        entry, raw = encode_tensor(name, value, binary)
        entries.append(entry)
        if raw is not None:
            buffers.append(raw)  # (an empty tensor's b"" too: the body is binary all the same)
    document["inputs"] = entries
    if outputs is not None:
        document["outputs"] = [
            {"name": name, "parameters": {"binary_data": True}} if binary else {"name": name}
            for name in outputs
        ]
    request_parameters = dict(parameters or {})
    if binary and outputs is None:
        request_parameters["binary_data_output"] = True
    if request_parameters:
        document["parameters"] = request_parameters
    header = _dumps(document)
    if not buffers:
        return Body(header, None)
    return Body(b"".join((header, *buffers)), len(header))


def encode_json_request(request: Mapping[str, Any]) -> Body:
    """A whole KServe v2 JSON request, sent as it is."""
    return Body(_dumps(request), None)


def decode_response(content: bytes, json_length: int | str | None) -> dict[str, np.ndarray]:
    """The outputs of an inference response, by name, shaped as the response says.

    Arrays own a writable copy of the body, not views of the (immutable) bytes received.
    BYTES outputs are object arrays of ``bytes``."""
    header, tail = split_body(content, json_length)
    document = parse_header(header)
    outputs = document.get("outputs")
    if not isinstance(outputs, list):
        raise MalformedResponse("malformed response: 'outputs' is missing or not a list")
    return decode_tensors(outputs, tail)


def split_body(content: bytes, json_length: int | str | None) -> tuple[bytes, memoryview]:
    """The JSON header and the binary tail of a body."""
    if json_length is None:
        return content, memoryview(b"")
    try:
        length = int(json_length)
    except ValueError:
        raise MalformedResponse(
            f"malformed response: {HEADER_LENGTH} {json_length!r} is not an integer"
        ) from None
    if not 0 < length <= len(content):
        raise MalformedResponse(
            f"malformed response: {HEADER_LENGTH} {length} is outside the body of "
            f"{len(content)} bytes"
        )
    return content[:length], memoryview(bytearray(memoryview(content)[length:]))


def parse_header(header: bytes) -> dict[str, Any]:
    try:
        document = json.loads(header)
    except (ValueError, UnicodeDecodeError) as exc:
        raise MalformedResponse(f"malformed response: the JSON header is invalid: {exc}") from None
    if not isinstance(document, dict):
        raise MalformedResponse("malformed response: the JSON header is not an object")
    return document


def decode_tensors(entries: Sequence[Any], tail: bytes | memoryview) -> dict[str, np.ndarray]:
    """Tensors from header entries (``name``, ``datatype``, ``shape`` and ``data`` or
    ``parameters.binary_data_size``) and the binary tail they take their bytes from, in
    order. Every byte of the tail must be accounted for."""
    view = memoryview(tail)
    offset = 0
    tensors: dict[str, np.ndarray] = {}
    for index, entry in enumerate(entries):
        name, datatype, shape = _entry_fields(index, entry)
        label = f"output '{name}'"
        parameters = entry.get("parameters") or {}
        size = parameters.get(BINARY_SIZE) if isinstance(parameters, dict) else None
        if "data" in entry:
            tensors[name] = _from_json(label, datatype, shape, entry["data"])
            continue
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise MalformedResponse(
                f"malformed response: {label} has neither 'data' nor a valid "
                f"parameters.{BINARY_SIZE}"
            )
        if offset + size > len(view):
            raise MalformedResponse(
                f"malformed response: {label} announces {size} bytes but only "
                f"{len(view) - offset} are left in the body"
            )
        tensors[name] = _from_binary(label, datatype, shape, view[offset : offset + size])
        offset += size
    if offset != len(view):
        raise MalformedResponse(
            f"malformed response: {len(view) - offset} bytes after the last output's data"
        )
    return tensors


def _entry_fields(index: int, entry: Any) -> tuple[str, str, tuple[int, ...]]:
    if not isinstance(entry, dict):
        raise MalformedResponse(f"malformed response: output {index} is not an object")
    name, datatype, shape = entry.get("name"), entry.get("datatype"), entry.get("shape")
    if not isinstance(name, str):
        raise MalformedResponse(f"malformed response: output {index} has no 'name'")
    if not isinstance(datatype, str):
        raise MalformedResponse(f"malformed response: output '{name}' has no 'datatype'")
    try:
        numpy_dtype(datatype)
    except KeyError:
        raise MalformedResponse(
            f"malformed response: output '{name}' has unknown datatype {datatype!r}"
        ) from None
    if not isinstance(shape, list) or not all(
        isinstance(dim, int) and not isinstance(dim, bool) and dim >= 0 for dim in shape
    ):
        raise MalformedResponse(
            f"malformed response: output '{name}' has no valid 'shape' (got {shape!r})"
        )
    return name, datatype, tuple(shape)


def _from_binary(label: str, datatype: str, shape: tuple[int, ...], raw: memoryview) -> np.ndarray:
    count = element_count(shape)
    element_size = ELEMENT_SIZE.get(datatype)
    if element_size is not None and len(raw) != element_size * count:
        raise MalformedResponse(
            f"malformed response: {label} has {len(raw)} bytes, but shape {list(shape)} of "
            f"{datatype} takes {element_size * count}"
        )
    try:
        array = to_numpy(datatype, (-1,), raw)
    except InvalidInput as exc:
        raise MalformedResponse(f"malformed response: {label}: {exc.message}") from None
    if array.size != count:
        raise MalformedResponse(
            f"malformed response: {label} has {array.size} BYTES elements, shape "
            f"{list(shape)} takes {count}"
        )
    return array.reshape(shape)


def _from_json(label: str, datatype: str, shape: tuple[int, ...], data: Any) -> np.ndarray:
    count = element_count(shape)
    if not isinstance(data, list):
        raise MalformedResponse(f"malformed response: {label}: 'data' is not a list")
    try:
        if datatype == BYTES:
            flat = np.asarray(data, dtype=np.object_).reshape(-1)
            array = np.empty(flat.size, dtype=np.object_)
            array[:] = [_json_bytes(label, element) for element in flat]
        else:
            array = np.asarray(data, dtype=numpy_dtype(datatype)).reshape(-1)
    except (ValueError, TypeError, OverflowError) as exc:
        raise MalformedResponse(
            f"malformed response: {label}: 'data' does not fit {datatype}: {exc}"
        ) from None
    if array.size != count:
        raise MalformedResponse(
            f"malformed response: {label} has {array.size} elements, shape {list(shape)} "
            f"takes {count}"
        )
    return array.reshape(shape)


def _json_bytes(label: str, element: Any) -> bytes:
    if isinstance(element, str):
        return element.encode()
    raise MalformedResponse(
        f"malformed response: {label}: BYTES data must be strings, got {type(element).__name__}"
    )
