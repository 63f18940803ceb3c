"""An inference request as the data plane holds it once checked, whatever its wire form
(REST JSON and binary tensors, gRPC): its inputs in Triton's binary layout (or references
to shared memory), the outputs asked for, its parameters; and the limits a request must
keep. Parsing and checking: :mod:`sluice.gateway.inference.parsing`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sluice.core.wire import ShmRef


@dataclass(slots=True)
class InputTensor:
    name: str
    datatype: str
    shape: tuple[int, ...]
    data: bytes | memoryview  # Triton binary layout (BYTES: length-prefixed elements)
    shm: ShmRef | None = None  # where the bytes are instead, for an input in a client region
    region: str = ""  # that region's name


@dataclass(slots=True)
class RequestedOutput:
    name: str
    binary: bool
    shm: ShmRef | None = None  # where the client wants the bytes written
    region: str = ""
    classes: int = 0  # > 0: answer the top-N classes (classification extension)
    # JSON asked for in so many words (binary_data / binary_data_output false): BYTES that
    # are not UTF-8 are then refused as Triton's clients refuse them, instead of going binary.
    json_asked: bool = False


@dataclass(slots=True)
class InferRequest:
    id: str
    inputs: list[InputTensor]
    # Explicit list in request order, or every model output in config order.
    outputs: list[RequestedOutput]
    # Request-level parameters minus binary_data_output (priority, timeout, ...).
    parameters: dict[str, Any]
    # 1 when max_batch_size == 0; else the first dim shared by all inputs.
    batch_size: int
    # Output name -> class count, for outputs asked to classify (None: none asked).
    classes: dict[str, int] | None = None


@dataclass(frozen=True, slots=True)
class RequestLimits:
    max_elements: int = 1 << 26  # per input tensor
    max_json_depth: int = 100  # nesting of JSON `data` (Triton's limit)
    max_inputs: int = 256
    max_string_length: int = 1 << 16  # names / id length
    # Request-level parameters: each travels in the stream entry's header and becomes an
    # object of the worker's (and a key of the JSON a Python model reads).
    max_parameters: int = 256


DEFAULT_LIMITS = RequestLimits()
