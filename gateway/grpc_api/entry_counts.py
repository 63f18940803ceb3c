"""A ModelInferRequest's top-level entries counted before the message is decoded.

Decoding makes an object of every entry of a repeated field: an empty ``inputs`` entry is
2 bytes on the wire and about 80 once decoded, so a message of nothing but empty entries
decodes into some 40 times its size (GiBs for one message at the default receive limit)
before any check could look at it. Its top-level fields are walked first, each
length-delimited one skipped, not read: a message with more ``inputs`` or
``raw_input_contents`` than a request may have inputs, more ``parameters`` than it may
have, more ``outputs`` than :data:`MAX_OUTPUTS`, or more fields than all of those together
is refused after at most that many steps, whatever its size. What is malformed is left to
the decoder to say.
"""

from __future__ import annotations

from sluice.core.errors import InvalidInput
from sluice.gateway.grpc_api.wire_fields import top_level_fields
from sluice.gateway.inference.request import RequestLimits

MAX_OUTPUTS = 4096
"""Outputs a request may name (each at most once, so more than any model has)."""

_PARAMETERS, _INPUTS, _OUTPUTS, _RAW = 4, 5, 6, 7
_SINGULAR_FIELDS = 16
"""Room for the singular fields (model name, version, id), even when repeated."""


def check_entry_counts(message: bytes, limits: RequestLimits) -> None:
    """Raise :class:`InvalidInput` when ``message`` holds more entries than a request may."""
    if len(message) <= 2 * min(limits.max_parameters, limits.max_inputs, MAX_OUTPUTS):
        return  # (every field takes 2 bytes or more: one this short passes every bound)
    bounds = {
        _PARAMETERS: ("parameters", limits.max_parameters),
        _INPUTS: ("inputs", limits.max_inputs),
        _OUTPUTS: ("outputs", MAX_OUTPUTS),
        _RAW: ("raw_input_contents", limits.max_inputs),
    }
    counts = dict.fromkeys(bounds, 0)
    most_fields = sum(bound for _, bound in bounds.values()) + _SINGULAR_FIELDS
    for index, field in enumerate(top_level_fields(message)):
        if index == most_fields:
            raise InvalidInput(
                f"the ModelInferRequest has more than {most_fields} fields, more than any "
                "request needs"
            )
        if field.number in counts:
            counts[field.number] += 1
            name, bound = bounds[field.number]
            if counts[field.number] > bound:
                raise InvalidInput(f"request '{name}' has more entries than the limit of {bound}")
