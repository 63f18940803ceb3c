"""Triton's binary tensor data extension: binary inputs as zero-copy slices of the body
after the JSON header, and the raw binary request (a header length of 0: the whole body is
the single input's bytes)."""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING

from sluice.core.datatypes import BYTES, ELEMENT_SIZE, count_bytes_elements, element_count
from sluice.core.errors import InvalidInput
from sluice.gateway.inference.json_tensors import fmt_shape
from sluice.gateway.inference.pending_input import PendingInput
from sluice.gateway.inference.request import (
    InferRequest,
    InputTensor,
    RequestedOutput,
    RequestLimits,
)
from sluice.gateway.inference.request_errors import (
    byte_size_message,
    log_request,
    string_count_message,
)

if TYPE_CHECKING:
    from sluice.core.config import ModelConfig


_MAX_BYTES_ELEMENT = (1 << 32) - 1


_LENGTH = struct.Struct("<I")


def slice_binary(
    entry: PendingInput,
    binary: memoryview,
    offset: int,
    no_header: bool,
    config: ModelConfig,
    request_id: str,
) -> memoryview:
    size = entry.binary_size
    assert size is not None
    element_size = ELEMENT_SIZE.get(entry.datatype)
    if element_size is not None and size != entry.count * element_size:
        raise InvalidInput(
            byte_size_message(entry, entry.count * element_size, size, config, request_id)
            + f"; parameters.binary_data_size is {size} but shape {fmt_shape(entry.shape)} "
            f"of {entry.datatype} needs {entry.count * element_size} bytes"
        )
    left = len(binary) - offset
    if size > left:
        hint = (
            " (binary data needs the Inference-Header-Content-Length header)" if no_header else ""
        )
        raise InvalidInput(
            f"unexpected size for input '{entry.name}', expecting {size - left} additional "
            f"bytes for model '{config.name}'; parameters.binary_data_size {size} exceeds the "
            f"{left} bytes of binary data left in the request body{hint}"
        )
    chunk = binary[offset : offset + size]
    if element_size is None:
        try:
            found = count_bytes_elements(chunk)
        except InvalidInput as exc:
            raise InvalidInput(f"{entry.label}: {exc.message}") from None
        if found != entry.count:
            raise InvalidInput(string_count_message(entry, found, config, request_id))
    return chunk


def parse_raw(view: memoryview, config: ModelConfig, limits: RequestLimits) -> InferRequest:
    """Triton's raw binary request: the whole body is the single input's data.

    Triton's rules (core ``InferenceRequest::Normalize``): the model has one input; its
    shape is the model's dims (after a batch dim of 1 for batching models) with at most
    one -1, deduced from the body's size; a BYTES input must have dims of one element and
    no -1 (e.g. ``[1]``) and the body is that one element. All outputs are binary."""
    prefix = log_request("")
    if len(config.inputs) != 1:
        raise InvalidInput(
            f"{prefix}Raw request must only have 1 input (found 1) to be deduced but got "
            f"{len(config.inputs)} inputs in '{config.name}' model configuration"
        )
    spec = config.inputs[0]
    label = f"input '{spec.name}'"
    dims = tuple(spec.dims)
    leading = (1,) if config.max_batch_size > 0 else ()
    size = len(view)
    variable = [index for index, dim in enumerate(dims) if dim == -1]
    fixed_count = element_count([d for d in dims if d != -1])
    data: bytes | memoryview
    if spec.datatype == BYTES:
        if variable or fixed_count != 1:
            raise InvalidInput(
                f"{prefix}For BYTE datatype raw input '{spec.name}', the model must have input "
                f"shape [1]; its shape is {fmt_shape(dims)}"
            )
        if size > _MAX_BYTES_ELEMENT:
            raise InvalidInput(f"{label}: raw BYTES element is longer than 2^32-1 bytes")
        shape = (*leading, *dims)
        data = b"".join((_LENGTH.pack(size), view))
    else:
        if len(variable) > 1:
            raise InvalidInput(
                f"{prefix}The shape of the raw input '{spec.name}' can not be deduced because "
                "there are more than one variable-sized dimension"
            )
        element_size = ELEMENT_SIZE[spec.datatype]
        resolved = list(dims)
        if variable:  # floor division, as Triton; a remainder fails the byte size check
            item_bytes = fixed_count * element_size
            resolved[variable[0]] = size // item_bytes if item_bytes else 0
        shape = (*leading, *resolved)
        expected = element_count(shape) * element_size
        if size != expected:
            raise InvalidInput(
                f"{prefix}input byte size mismatch for input '{spec.name}' for model "
                f"'{config.name}'. Expected {expected}, got {size}; the raw body is not a "
                f"whole number of {spec.datatype} items of model shape {fmt_shape(dims)}"
            )
        data = view
    count = element_count(shape)
    if count > limits.max_elements:
        raise InvalidInput(
            f"{label}: shape {fmt_shape(shape)} has {count} elements, more than the limit of "
            f"{limits.max_elements}"
        )
    return InferRequest(
        id="",
        inputs=[InputTensor(spec.name, spec.datatype, shape, data)],
        outputs=[RequestedOutput(output.name, True) for output in config.outputs],
        parameters={},
        batch_size=1,
    )
