"""Between gRPC's ``ModelInferRequest`` / ``ModelInferResponse`` and the gateway's own forms.

A request becomes the JSON document the REST path parses (``inputs`` with ``parameters``)
plus its tensors' bytes one after the other, each input announced by the
``binary_data_size`` of its raw or typed contents: from there both wires share one parser
(:func:`sluice.gateway.inference.parsing.parse_infer_document`) and so every check and message.
Typed ``contents`` are turned into Triton's binary layout here, as Triton's own gRPC
handler does (``int_contents`` narrowed to INT8 / INT16, ``bytes_contents`` length-prefixed),
with Triton's texts when they do not fit the input's datatype. Reserved parameters must be
of the kind Triton takes (:mod:`sluice.gateway.grpc_api.parameter_kinds`). Of a tensor's
parameters only those a tensor can use are read (shared memory, classification): the
others are ignored, as Triton ignores them, however many there are.

An answer carries every output in ``raw_output_contents``, in order (an empty entry for an
output written into the client's shared memory), as Triton's does.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from typing import Any

import numpy as np

from sluice.core.errors import InvalidInput
from sluice.gateway.inference.fields import MAX_DIMS
from sluice.gateway.inference.response import OutputTensor, checked_nbytes

from .packed_contents import contents_bytes
from .parameter_kinds import class_count, request_parameter, shared_memory_parameters
from .protocol import service_pb2

_LENGTH = struct.Struct("<I")
_BINARY_SIZE = "binary_data_size"
_REST_ONLY = frozenset((_BINARY_SIZE, "binary_data", "binary_data_output"))
"""Parameters of the binary tensor extension: meaningless over gRPC, where every tensor
travels raw, and never taken from a client here."""
_SHM = "shared_memory_region"
_CLASSIFICATION = "classification"

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


def _request_parameters(parameters: Any) -> dict[str, Any]:
    if not parameters:  # (most requests carry none: no items view to make)
        return {}
    return {
        name: request_parameter(name, value)
        for name, value in parameters.items()
        if name not in _REST_ONLY
    }


def _output_entry(output: Any) -> dict[str, Any]:
    """A requested output's REST form; its class count checked as Triton's gRPC does."""
    given = output.parameters
    parameters = shared_memory_parameters(output.name, given)
    if given and _CLASSIFICATION in given:
        parameters[_CLASSIFICATION] = class_count(given[_CLASSIFICATION])
    return {"name": output.name, "parameters": parameters}


def request_document(request: Any) -> tuple[dict[str, Any], memoryview]:
    """The REST form of a ``ModelInferRequest``: its JSON document and its tensors' bytes.
    Its parameters are read first, as Triton reads them."""
    model = request.model_name
    request_parameters = _request_parameters(request.parameters)
    raw = request.raw_input_contents
    chunks: list[bytes | bytearray | memoryview] = []
    inputs: list[dict[str, Any]] = []
    taken = 0
    for tensor in request.inputs:
        dims = len(tensor.shape)
        if dims > MAX_DIMS:
            raise InvalidInput(
                f"input '{tensor.name}': 'shape' has {dims} dims, more than the limit of {MAX_DIMS}"
            )
        parameters = shared_memory_parameters(tensor.name, tensor.parameters)
        entry: dict[str, Any] = {
            "name": tensor.name,
            "datatype": tensor.datatype,
            "shape": list(tensor.shape),
            "parameters": parameters,
        }
        inputs.append(entry)
        has_contents = tensor.HasField("contents")
        if _SHM in parameters:
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
    outputs = [_output_entry(output) for output in request.outputs]
    document: dict[str, Any] = {
        "id": request.id,
        "parameters": request_parameters,
        "inputs": inputs,
        "outputs": outputs,
    }
    return document, memoryview(b"".join(chunks))


def _typed_contents(tensor: Any, model: str) -> bytes | bytearray | memoryview:
    """An input's typed contents in Triton's binary layout, checked as Triton checks them
    (numeric ones from their packed encoding: :mod:`.packed_contents`)."""
    contents = tensor.contents
    datatype = tensor.datatype
    found: bytes | bytearray | memoryview | None = None
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
            found = _length_prefixed(values)
            continue
        # (narrowed: the low bytes of each value, as Triton takes them)
        found = contents_bytes(contents, field, numpy_type, _NARROWED.get(datatype))
    # Empty contents: a tensor of no elements, or a size error from the parser.
    return found if found is not None else b""


def _length_prefixed(values: Any) -> bytearray:
    """``bytes_contents`` in Triton's BYTES layout, each value preceded by its length."""
    out = bytearray()
    pack = _LENGTH.pack
    for value in values:
        out += pack(len(value))
        out += value
    return out


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
