"""Tensors in shared memory regions (Triton's system and CUDA shared memory extensions):
the ``shared_memory_*`` parameters of an input or output, checked against the registered
region; the tensor then carries the resolved location, no bytes."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from sluice.core.datatypes import ELEMENT_SIZE, count_bytes_elements
from sluice.core.errors import InvalidInput
from sluice.core.wire import ShmRef
from sluice.gateway.inference.json_parameters import NON_STRING, uint64_parameter, unparsable
from sluice.gateway.inference.json_tensors import fmt_shape
from sluice.gateway.inference.pending_input import PendingInput, ShmParameters
from sluice.gateway.inference.request import InputTensor
from sluice.gateway.inference.request_errors import byte_size_message, string_count_message

if TYPE_CHECKING:
    from sluice.core.config import ModelConfig


SHM_REGION = "shared_memory_region"


SHM_SIZE = "shared_memory_byte_size"


SHM_OFFSET = "shared_memory_offset"


class RegionLookup(Protocol):
    """The shared memory regions requests may reference (the gateway's registry)."""

    def resolve(
        self, label: str, name: str, offset: int, byte_size: int, *, output: bool = False
    ) -> ShmRef: ...

    def read(self, label: str, region: str, ref: ShmRef) -> memoryview: ...


class NoRegions:
    def resolve(
        self, label: str, name: str, offset: int, byte_size: int, *, output: bool = False
    ) -> ShmRef:
        raise InvalidInput(f"{label}: unknown shared memory region '{name}'")

    def read(self, label: str, region: str, ref: ShmRef) -> memoryview:  # pragma: no cover
        raise InvalidInput(f"{label}: unknown shared memory region '{region}'")


def parse_shm_parameters(
    label: str, tensor: str, parameters: dict[str, Any]
) -> ShmParameters | None:
    """The shared memory reference of tensor ``tensor`` (``label`` names it in Sluice's
    detail), read as Triton's HTTP frontend reads it: the region a string, then offset and
    byte size unsigned 64-bit integers, with its texts. Where that frontend would go on
    without a region (an offset or a byte size alone is ignored) or with a byte size of 0
    (no byte size given), the request is refused with Triton's gRPC texts for them (see
    ``docs/differences.md``). The offset is optional (0)."""
    has_region = SHM_REGION in parameters
    has_offset = SHM_OFFSET in parameters
    has_size = SHM_SIZE in parameters
    if not (has_region or has_offset or has_size):
        return None
    suffix = f"; {label}"
    region = parameters.get(SHM_REGION)
    if has_region and not isinstance(region, str):
        raise InvalidInput(f"{unparsable(SHM_REGION, NON_STRING)}{suffix}")
    offset = uint64_parameter(SHM_OFFSET, parameters[SHM_OFFSET], suffix) if has_offset else 0
    size = uint64_parameter(SHM_SIZE, parameters[SHM_SIZE], suffix) if has_size else None
    if region is None:
        raise InvalidInput(without_region(SHM_OFFSET if has_offset else SHM_SIZE, tensor))
    if size is None:
        raise InvalidInput(without_size(tensor))
    return ShmParameters(region, offset, size)


def without_region(name: str, tensor: str) -> str:
    """Triton's text (gRPC frontend) for an offset or byte size given without a region."""
    return f"'{name}' can not be specified without '{SHM_REGION}' parameter for tensor '{tensor}'"


def without_size(tensor: str) -> str:
    """Triton's text (gRPC frontend) for a region given without its byte size."""
    return (
        f"'{SHM_SIZE}' must be specified along with '{SHM_REGION}' parameter for tensor '{tensor}'"
    )


def shm_input(
    entry: PendingInput,
    shm: ShmParameters,
    regions: RegionLookup,
    config: ModelConfig,
    request_id: str,
) -> InputTensor:
    label = entry.label
    element_size = ELEMENT_SIZE.get(entry.datatype)
    if element_size is not None and shm.byte_size != entry.count * element_size:
        raise InvalidInput(
            byte_size_message(entry, entry.count * element_size, shm.byte_size, config, request_id)
            + f"; parameters.{SHM_SIZE} is {shm.byte_size} but shape "
            f"{fmt_shape(entry.shape)} of {entry.datatype} needs "
            f"{entry.count * element_size} bytes"
        )
    ref = regions.resolve(label, shm.region, shm.offset, shm.byte_size)
    if element_size is None:
        data = regions.read(label, shm.region, ref)
        try:
            found = count_bytes_elements(data)
        except InvalidInput as exc:
            raise InvalidInput(f"{label}: region '{shm.region}': {exc.message}") from None
        if found != entry.count:
            detail = (
                f"{label}: the {shm.byte_size} bytes at offset {shm.offset} of region "
                f"'{shm.region}' hold {found} BYTES elements, shape {fmt_shape(entry.shape)} "
                f"needs {entry.count}"
            )
            raise InvalidInput(string_count_message(entry, found, config, request_id, detail))
    return InputTensor(entry.name, entry.datatype, entry.shape, b"", ref, shm.region)
