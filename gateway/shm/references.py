"""Tensors in shared memory regions (Triton's system and CUDA shared memory extensions):
the ``shared_memory_*`` parameters of an input or output, checked against the registered
region; the tensor then carries the resolved location, no bytes."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from sluice.core.datatypes import ELEMENT_SIZE, count_bytes_elements
from sluice.core.errors import InvalidInput
from sluice.core.fields import json_type
from sluice.core.wire import ShmRef
from sluice.gateway.inference.fields import natural_parameter
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


def parse_shm_parameters(label: str, parameters: dict[str, Any]) -> ShmParameters | None:
    """Triton's rules: region and byte size go together, the offset is optional (0)."""
    if not (SHM_REGION in parameters or SHM_SIZE in parameters or SHM_OFFSET in parameters):
        return None
    region, size = parameters.get(SHM_REGION), parameters.get(SHM_SIZE)
    if region is None or size is None:
        raise InvalidInput(
            f"{label}: parameters.{SHM_REGION} and parameters.{SHM_SIZE} must be given together"
        )
    if not isinstance(region, str) or not region:
        shown = "empty" if region == "" else json_type(region)
        raise InvalidInput(
            f"{label}: parameters.{SHM_REGION} must be a non-empty string, got {shown}"
        )
    return ShmParameters(
        region,
        natural_parameter(label, SHM_OFFSET, parameters.get(SHM_OFFSET, 0)),
        natural_parameter(label, SHM_SIZE, size),
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
