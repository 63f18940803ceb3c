"""Which gRPC requests are decoded and parsed on a thread, told before decoding them.

Decoding a ``ModelInferRequest`` and turning it into the REST path's form costs per
element, not per byte, for what lies in its ``inputs`` (typed contents: up to ~150 ns a
byte for ``bytes_contents`` of empty strings, ~45 for varint integers of more than one
byte; ~5 for integers and booleans of one byte and under 1 for ``fp32_contents`` /
``fp64_contents``, taken from their packed encoding: :mod:`.packed_contents`) and for BYTES
tensors in ``raw_input_contents`` (their elements are counted one by one); other raw
tensors are taken whole. A message is decoded on the event loop only when those bytes are
at most
:data:`~sluice.gateway.inference.data_plane.PARSED_ON_LOOP_BYTES` and the whole message at
most :data:`~sluice.gateway.inference.data_plane.OFFLOAD_BYTES`. The small message of the
hot path (a few raw tensors) stays on the loop; telling costs a walk of at most
:data:`FIELDS_ON_LOOP` top-level fields (:mod:`.wire_fields`), and nothing for a message of
at most :data:`SHORT_BYTES`. A message with more fields goes to a thread, however short:
its entries are counted before it is decoded (:mod:`.entry_counts`), a walk of up to one
field per 2 bytes (a 4 KiB message of empty entries took 4.5 ms of the loop).
``bench.parse_cost`` measures each kind.
"""

from __future__ import annotations

from sluice.gateway.inference.data_plane import OFFLOAD_BYTES, PARSED_ON_LOOP_BYTES

from .wire_fields import top_level_fields

FIELDS_ON_LOOP = 32
"""The most top-level fields walked on the loop: a message with more goes to a thread
(each of its entries is an object once decoded; a walk costs ~1.5 µs a field)."""

SHORT_BYTES = 512
"""A message this short holds at most 256 fields (each takes 2 bytes or more): it is decoded,
counted and parsed on the loop without a look."""

_INPUTS, _RAW = 5, 7
_BYTES = b"BYTES"


def decoded_on_thread(message: bytes) -> bool:
    """Whether ``message`` (a ``ModelInferRequest``) is decoded and parsed on a thread."""
    size = len(message)
    if size > OFFLOAD_BYTES:
        return True
    if size <= SHORT_BYTES:
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
    if raw <= PARSED_ON_LOOP_BYTES:
        return False
    # The raw tensors are more than PARSED_ON_LOOP_BYTES: a BYTES one is counted.
    return any(message.find(_BYTES, start, end) >= 0 for start, end in inputs)
