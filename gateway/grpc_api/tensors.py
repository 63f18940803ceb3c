"""Between gRPC's ``ModelInferRequest`` / ``ModelInferResponse`` and the gateway's own forms.

A request becomes the JSON document the REST path parses (``inputs`` with ``parameters``)
plus its tensors' bytes one after the other, each input announced by the
``binary_data_size`` of its raw or typed contents: from there both wires share one parser
(:func:`sluice.gateway.inference.parsing.parse_infer_document`) and so every check and message.
Typed ``contents`` are turned into Triton's binary layout here, as Triton's own gRPC
handler does (``int_contents`` narrowed to INT8 / INT16, ``bytes_contents`` length-prefixed),
with Triton's texts when they do not fit the input's datatype.

An answer carries every output in ``raw_output_contents``, in order (an empty entry for an
output written into the client's shared memory), as Triton's does.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from typing import Any

import numpy as np
from google.protobuf.message import Message

from sluice.core.errors import InvalidInput
from sluice.gateway.inference.response import OutputTensor, checked_nbytes

from .protocol import service_pb2

_LENGTH = struct.Struct("<I")
_BINARY_SIZE = "binary_data_size"
_REST_ONLY = frozenset((_BINARY_SIZE, "binary_data", "binary_data_output"))
"""Parameters of the binary tensor extension: meaningless over gRPC, where every tensor
travels raw, and never taken from a client here."""

# Typed contents: field -> (the datatype Triton calls it, numpy type of the field's values).
_CONTENTS: tuple[tuple[str, str, Any], ...] = (
    ("bool_contents", "BOOL", np.bool_),
    ("int_contents", "INT32", np.int32),
    ("int64_contents", "INT64", np.int64),
    ("uint_contents", "UINT32", np.uint32),
    ("uint64_contents", "UINT64", np.uint64),
    ("fp32_contents", "FP32", np.float32),
    ("fp64_contents", "FP64", np.float64),
    ("bytes_contents", "BYTES", None),
)
_NARROWED = {"INT8": np.int8, "INT16": np.int16, "UINT8": np.uint8, "UINT16": np.uint16}
"""Datatypes whose typed contents come in a wider field (int_contents / uint_contents)."""
_WIDE = {"INT8": "INT32", "INT16": "INT32", "UINT8": "UINT32", "UINT16": "UINT32"}


def parameter_value(name: str, parameter: Message) -> Any:
    """The Python value of an ``InferParameter`` (or a repository parameter)."""
    which = parameter.WhichOneof("parameter_choice")
    if which is None:
        raise InvalidInput(f"invalid value type for '{name}' parameter: no value is set")
    return getattr(parameter, which)


def parameters_dict(parameters: Any, skip: frozenset[str] = frozenset()) -> dict[str, Any]:
    if not parameters:  # (most tensors and requests carry none: no items view to make)
        return {}
    return {
        name: parameter_value(name, value) for name, value in parameters.items() if name not in skip
    }


def request_document(request: Any) -> tuple[dict[str, Any], memoryview]:
    """The REST form of a ``ModelInferRequest``: its JSON document and its tensors' bytes."""
    model = request.model_name
    raw = request.raw_input_contents
    chunks: list[bytes] = []
    inputs: list[dict[str, Any]] = []
    taken = 0
    for tensor in request.inputs:
        parameters = parameters_dict(tensor.parameters, _REST_ONLY)
        entry: dict[str, Any] = {
            "name": tensor.name,
            "datatype": tensor.datatype,
            "shape": list(tensor.shape),
            "parameters": parameters,
        }
        inputs.append(entry)
        has_contents = tensor.HasField("contents")
        if "shared_memory_region" in parameters:
            if has_contents:
                raise InvalidInput(
                    "unexpected 'content' provided when using shared memory for input tensor "
                    f"'{tensor.name}' for model '{model}'"
                )
            continue
        if has_contents:
            if raw:
                raise InvalidInput(
                    "contents field must not be specified when using raw_input_contents for "
                    f"'{tensor.name}' for model '{model}'"
                )
            chunk = _typed_contents(tensor, model)
        elif taken < len(raw):
            chunk = raw[taken]
            taken += 1
        else:
            raise InvalidInput(
                f"unable to find data for input tensor '{tensor.name}' for model '{model}' "
                "in request."
            )
        parameters[_BINARY_SIZE] = len(chunk)
        chunks.append(chunk)
    if taken < len(raw):
        raise InvalidInput(
            f"unexpected additional input data for model '{model}'; the request has "
            f"{len(raw)} raw_input_contents but only {taken} inputs take their data from there"
        )
    outputs = [
        {"name": output.name, "parameters": parameters_dict(output.parameters, _REST_ONLY)}
        for output in request.outputs
    ]
    document: dict[str, Any] = {
        "id": request.id,
        "parameters": parameters_dict(request.parameters, _REST_ONLY),
        "inputs": inputs,
        "outputs": outputs,
    }
    return document, memoryview(b"".join(chunks))


def _typed_contents(tensor: Any, model: str) -> bytes:
    """An input's typed contents in Triton's binary layout, checked as Triton checks them."""
    contents = tensor.contents
    datatype = tensor.datatype
    found: bytes | None = None
    for field, kind, numpy_type in _CONTENTS:
        values = getattr(contents, field)
        if not values:
            continue
        expected = _WIDE.get(datatype, datatype)
        if found is not None:
            raise InvalidInput(
                f"unexpected explicit tensor data for input tensor '{tensor.name}' for model "
                f"'{model}', binary data was already supplied."
            )
        if kind != expected:
            raise InvalidInput(
                f"unexpected explicit tensor data for input tensor '{tensor.name}' for model "
                f"'{model}' of type '{kind}', expected datatype '{datatype}'"
            )
        if numpy_type is None:
            found = b"".join(_LENGTH.pack(len(value)) + value for value in values)
            continue
        array = np.asarray(values, dtype=numpy_type)
        narrowed = _NARROWED.get(datatype)
        if narrowed is not None:  # the low bytes of each value, as Triton takes them
            array = array.astype(narrowed)
        found = array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes()
    # Empty contents: a tensor of no elements, or a size error from the parser.
    return found if found is not None else b""


def encode_response(
    model: str,
    version: str,
    request_id: str,
    outputs: list[OutputTensor],
    parameters: Mapping[str, bool | int | str] | None = None,
) -> bytes:
    """The serialized ``ModelInferResponse`` for a worker's outputs (and the response's own
    ``parameters``, an ensemble's sequence flags)."""
    response = service_pb2.ModelInferResponse(
        model_name=model, model_version=version, id=request_id
    )
    for name, value in (parameters or {}).items():
        if isinstance(value, bool):
            response.parameters[name].bool_param = value
        elif isinstance(value, int):
            response.parameters[name].int64_param = value
        else:
            response.parameters[name].string_param = value
    for output in outputs:
        nbytes = checked_nbytes(output)
        tensor = response.outputs.add(
            name=output.name, datatype=output.datatype, shape=output.shape
        )
        if output.region:
            tensor.parameters["shared_memory_region"].string_param = output.region
            tensor.parameters["shared_memory_byte_size"].int64_param = nbytes
            response.raw_output_contents.append(b"")
        else:
            response.raw_output_contents.append(bytes(output.data))
    serialized: bytes = response.SerializeToString()
    return serialized
