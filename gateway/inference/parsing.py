"""Parse and validate a KServe v2 / Triton inference request.

The HTTP body is a JSON header optionally followed by binary tensor data (Triton's binary
tensor data extension, :mod:`sluice.gateway.inference.binary_tensors`);
``Inference-Header-Content-Length`` gives the header length. Every input ends up in Triton's
binary layout: binary inputs as zero-copy slices of the body, JSON ``data`` converted once
through numpy (:mod:`sluice.gateway.inference.json_tensors`). An input or output may instead
live in a registered shared memory region (:mod:`sluice.gateway.shm.references`).

Every problem raises :class:`~sluice.core.errors.InvalidInput` with a message that names the
offending field. Checks run cheapest first: the request's structure, input names
(:mod:`sluice.gateway.inference.input_headers`), datatypes and shapes
(:mod:`sluice.gateway.inference.metadata_checks`), requested outputs
(:mod:`sluice.gateway.inference.requested_outputs`), then the tensor data. Where Triton refuses the
same request, the message is Triton's own (:mod:`sluice.gateway.inference.request_errors`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import orjson

from sluice.core.errors import InvalidInput
from sluice.core.fields import json_type
from sluice.gateway.inference.binary_tensors import parse_raw, slice_binary
from sluice.gateway.inference.fields import (
    TRITON_PARAMETERS,
    parse_id,
    parse_request_parameters,
)
from sluice.gateway.inference.input_headers import parse_input_headers
from sluice.gateway.inference.json_tensors import (
    BytesCountMismatch,
    json_to_buffer,
    nesting_message,
)
from sluice.gateway.inference.metadata_checks import check_input_specs
from sluice.gateway.inference.pending_input import PendingInput
from sluice.gateway.inference.request import (
    DEFAULT_LIMITS,
    InferRequest,
    InputTensor,
    RequestLimits,
)
from sluice.gateway.inference.request_errors import string_count_message
from sluice.gateway.inference.requested_outputs import parse_outputs
from sluice.gateway.shm.references import NoRegions, RegionLookup, shm_input

if TYPE_CHECKING:
    from sluice.core.config import ModelConfig

_NO_TRITON_NAMES: frozenset[str] = frozenset()
"""Triton's HTTP frontend refuses every request parameter starting with ``triton_``."""


def parse_infer_request(
    body: bytes | bytearray | memoryview,
    header_length: int | None,
    config: ModelConfig,
    limits: RequestLimits = DEFAULT_LIMITS,
    regions: RegionLookup | None = None,
) -> InferRequest:
    """Validate ``body`` against ``config`` and return the decoded request.

    ``regions`` resolves shared memory references (none are registered when None).
    """
    lookup: RegionLookup = regions if regions is not None else NoRegions()
    view = memoryview(body)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    size = len(view)
    if header_length is not None:
        if isinstance(header_length, bool) or not isinstance(header_length, int):
            raise InvalidInput("Inference-Header-Content-Length must be an integer")
        if not 0 <= header_length <= size:
            raise InvalidInput(
                f"Inference-Header-Content-Length {header_length} is outside the "
                f"request body of {size} bytes"
            )
        if header_length == 0:
            return parse_raw(view, config, limits)
        header, binary = view[:header_length], view[header_length:]
    else:
        header, binary = view, view[size:]

    try:
        doc = orjson.loads(header)
    except orjson.JSONDecodeError as exc:
        raise InvalidInput(malformed_body_message(exc, limits)) from None
    if not isinstance(doc, dict):
        raise InvalidInput(f"malformed request body: expected a JSON object, got {json_type(doc)}")
    return parse_infer_document(
        doc, binary, config, limits, lookup, header_length is None, allowed=_NO_TRITON_NAMES
    )


_ORJSON_TOO_DEEP = "depth limit exceeded"


def malformed_body_message(exc: orjson.JSONDecodeError, limits: RequestLimits) -> str:
    """orjson refuses JSON nested deeper than 1024 levels itself (without recursion), far
    beyond the depth ``data`` may have: that refusal carries Triton's nesting text too."""
    if str(exc).startswith(_ORJSON_TOO_DEEP):
        return f"{nesting_message(limits.max_json_depth)}; malformed request body: {exc}"
    return f"malformed request body: {exc}"


def parse_infer_document(
    doc: dict[str, Any],
    binary: memoryview,
    config: ModelConfig,
    limits: RequestLimits = DEFAULT_LIMITS,
    regions: RegionLookup | None = None,
    no_header: bool = False,
    *,
    allowed: frozenset[str] | None = TRITON_PARAMETERS,
) -> InferRequest:
    """Validate a request already decoded into the JSON form (``doc``) whose binary inputs
    lie one after the other in ``binary``: the JSON body's header and the gRPC message
    (see :mod:`sluice.gateway.grpc_api.tensors`) both end here, so both are checked the same way.
    ``no_header``: the body came without Inference-Header-Content-Length (for the hint).
    ``allowed``: the request parameters starting with ``triton_`` it may carry (None: any,
    as plain parameters)."""
    lookup: RegionLookup = regions if regions is not None else NoRegions()
    request_id = parse_id(doc.get("id"), limits)
    parameters, binary_output = parse_request_parameters(doc.get("parameters"), limits, allowed)
    pending = parse_input_headers(doc.get("inputs"), config, limits, request_id)
    outputs, classes = parse_outputs(
        doc.get("outputs"), config, binary_output, limits, lookup, request_id
    )
    batch_size = check_input_specs(pending, config, limits, request_id)
    inputs = read_input_data(pending, binary, no_header, limits, lookup, config, request_id)
    return InferRequest(
        id=request_id,
        inputs=inputs,
        outputs=outputs,
        parameters=parameters,
        batch_size=batch_size,
        classes=classes,
    )


def read_input_data(
    pending: list[PendingInput],
    binary: memoryview,
    no_header: bool,
    limits: RequestLimits,
    regions: RegionLookup,
    config: ModelConfig,
    request_id: str,
) -> list[InputTensor]:
    inputs: list[InputTensor] = []
    offset = 0
    available = len(binary)
    for entry in pending:
        if entry.shm is not None:
            inputs.append(shm_input(entry, entry.shm, regions, config, request_id))
            continue
        if entry.binary_size is None:
            try:
                data = json_to_buffer(
                    entry.label,
                    entry.datatype,
                    entry.shape,
                    entry.count,
                    entry.data,
                    limits.max_json_depth,
                )
            except BytesCountMismatch as exc:
                raise InvalidInput(
                    string_count_message(entry, exc.found, config, request_id)
                ) from None
        else:
            data = slice_binary(entry, binary, offset, no_header, config, request_id)
            offset += entry.binary_size
        inputs.append(InputTensor(entry.name, entry.datatype, entry.shape, data))
    if offset != available:
        raise InvalidInput(
            f"unexpected additional input data for model '{config.name}'; the request body has "
            f"{available - offset} bytes after the JSON header that no input's "
            "parameters.binary_data_size accounts for"
        )
    return inputs
