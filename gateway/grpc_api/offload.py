"""Which gRPC requests are decoded and parsed on a thread, told before decoding them.

Decoding a ``ModelInferRequest`` and turning it into the REST path's form costs per
element, not per byte, for what lies in its ``inputs`` (typed contents: up to ~150 ns a
byte for ``bytes_contents`` of empty strings, ~45 for varint integers, ~11 for
``fp32_contents``) and for BYTES tensors in ``raw_input_contents`` (their elements are
counted one by one); other raw tensors are taken whole. A message is decoded on the event
loop only when those bytes are at most
:data:`~sluice.gateway.inference.data_plane.PARSED_ON_LOOP_BYTES` and the whole message at
most :data:`~sluice.gateway.inference.data_plane.OFFLOAD_BYTES`. The small message of the
hot path (a few raw tensors) stays on the loop; telling costs a walk of at most
:data:`FIELDS_ON_LOOP` top-level fields (:mod:`.wire_fields`), and nothing for a message of
at most ``PARSED_ON_LOOP_BYTES``, whatever it holds. ``bench.parse_cost`` measures each kind.
"""

from __future__ import annotations

from sluice.gateway.inference.data_plane import OFFLOAD_BYTES, PARSED_ON_LOOP_BYTES

from .wire_fields import top_level_fields

FIELDS_ON_LOOP = 32
"""The most top-level fields walked on the loop: a message with more goes to a thread
(each of its entries is an object once decoded; a walk costs ~1.5 µs a field)."""

_INPUTS, _RAW = 5, 7
_BYTES = b"BYTES"


def decoded_on_thread(message: bytes) -> bool:
    """Whether ``message`` (a ``ModelInferRequest``) is decoded and parsed on a thread."""
    size = len(message)
    if size > OFFLOAD_BYTES:
        return True
    if size <= PARSED_ON_LOOP_BYTES:
        return False
    raw = 0
    inputs: list[tuple[int, int]] = []
    for index, field in enumerate(top_level_fields(message)):
        if index == FIELDS_ON_LOOP:
            return True
        if field.number == _RAW:
            raw += min(field.end, size) - field.start
        elif field.number == _INPUTS:
            inputs.append((field.start, field.end))
    if size - raw > PARSED_ON_LOOP_BYTES:
        return True  # (typed contents, or many small fields)
    # The raw tensors are more than PARSED_ON_LOOP_BYTES: a BYTES one is counted.
    return any(message.find(_BYTES, start, end) >= 0 for start, end in inputs)
