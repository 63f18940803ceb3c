"""Inputs checked against the model's metadata: batch sizes, datatypes, shapes and the
element limit, in Triton's order (core ``InferenceRequest::Normalize``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from sluice.core.datatypes import element_count
from sluice.core.errors import InvalidInput
from sluice.gateway.inference.json_tensors import fmt_shape
from sluice.gateway.inference.pending_input import PendingInput
from sluice.gateway.inference.request import RequestLimits
from sluice.gateway.inference.request_errors import log_request

if TYPE_CHECKING:
    from sluice.core.config import ModelConfig


_BATCH_NOTE = (
    "NOTE: Setting a non-zero max_batch_size in the model config requires a batch dimension "
    "to be prepended to each input shape. If you want to specify the full shape including "
    "the batch dim in your input dims config, try setting max_batch_size to zero. See the "
    "model configuration docs for more info on max_batch_size."
)
"""Triton appends this to a shape mismatch for a batching model."""


def check_input_specs(
    pending: list[PendingInput], config: ModelConfig, limits: RequestLimits, request_id: str
) -> int:
    """Batch sizes, datatypes, shapes and element limits; returns the batch size.

    In Triton's order: every input's batch dim first, then the batch limit, then each
    input's datatype and shape."""
    max_batch = config.max_batch_size
    batch: int | None = None
    if max_batch > 0:
        batch_from = ""
        for entry in pending:
            if not entry.shape:
                raise InvalidInput(
                    f"{log_request(request_id)}input '{entry.name}' has no shape but model "
                    f"requires batch dimension for '{config.name}'"
                )
            if batch is None:
                batch, batch_from = entry.shape[0], entry.name
            elif entry.shape[0] != batch:
                raise InvalidInput(
                    f"{log_request(request_id)}input '{entry.name}' batch size does not match "
                    f"other inputs for '{config.name}'; {entry.shape[0]} here, {batch} in "
                    f"input '{batch_from}'"
                )
        assert batch is not None
        if batch > max_batch:
            raise InvalidInput(
                f"{log_request(request_id)}inference request batch-size must be <= {max_batch} for "
                f"'{config.name}'; input '{batch_from}' has batch size {batch}"
            )
        if batch < 1:
            raise InvalidInput(f"{pending[0].label}: batch size must be at least 1, got {batch}")
    first = 1 if max_batch > 0 else 0  # the model's dims start after the batch dim
    for entry in pending:
        spec = entry.spec
        assert spec is not None
        if entry.datatype != spec.datatype:
            raise InvalidInput(
                f"{log_request(request_id)}inference input '{entry.name}' data-type is "
                f"'{entry.datatype}', but model '{config.name}' expects '{spec.datatype}'"
            )
        shape, dims = entry.shape, spec.dims
        if len(shape) != len(dims) + first:
            raise _shape_error(entry, dims, config, request_id)
        for index, want in enumerate(dims):
            if want != shape[index + first] and want != -1:
                raise _shape_error(entry, dims, config, request_id)
        entry.count = element_count(shape)
        if entry.count > limits.max_elements:
            raise InvalidInput(
                f"{entry.label}: shape {fmt_shape(entry.shape)} has {entry.count} elements, "
                f"more than the limit of {limits.max_elements}"
            )
    return 1 if batch is None else batch


def _shape_error(
    entry: PendingInput, dims: Sequence[int], config: ModelConfig, request_id: str
) -> InvalidInput:
    """Triton's text for a shape (batch dim included) that does not fit the model's dims."""
    batched = config.max_batch_size > 0
    expected = (-1, *dims) if batched else tuple(dims)
    shape = entry.shape
    note = _BATCH_NOTE if batched else ""
    return InvalidInput(
        f"{log_request(request_id)}unexpected shape for input '{entry.name}' for model "
        f"'{config.name}'. "
        f"Expected {fmt_shape(expected)}, got {fmt_shape(shape)}. {note}"
    )
