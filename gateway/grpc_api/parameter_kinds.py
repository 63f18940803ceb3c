"""The value of an ``InferParameter``, checked against the kind (oneof) Triton's gRPC
frontend wants for its reserved names, with Triton's texts (server ``src/grpc``:
``SetInferenceRequestMetadata``, ``ParseClassificationParams``,
``ParseSharedMemoryParams``).

Over REST a parameter's type is its JSON type, checked by the shared parser. A gRPC
parameter says more: ``int64_param`` and ``uint64_param`` both become Python integers, and
Triton refuses a reserved parameter given in another kind than its own, for every model
(a ``sequence_start`` that is an integer, a ``timeout`` that is a ``uint64_param``), before
anything else of the request is looked at. Custom parameters take any kind (see
``docs/differences.md``).
"""

from __future__ import annotations

from typing import Any

from google.protobuf.message import Message

from sluice.core.errors import InvalidInput
from sluice.gateway.shm.references import without_region, without_size

_CHOICE = "parameter_choice"
_UINT64 = 1 << 64

_REQUEST_KINDS: dict[str, tuple[str, ...]] = {
    "sequence_id": ("int64_param", "string_param"),
    "sequence_start": ("bool_param",),
    "sequence_end": ("bool_param",),
    "priority": ("int64_param", "uint64_param"),
    "timeout": ("int64_param",),
    "triton_enable_empty_final_response": ("bool_param",),
}
"""Request parameters Triton reads itself, and the kinds it takes for each."""

_RESERVED_PREFIX = "triton_"
_RESERVED = (
    f"parameter keys starting with '{_RESERVED_PREFIX}' are reserved for Triton usage. "
    f"Only the following keys starting with '{_RESERVED_PREFIX}' are allowed: "
    + " ".join(name for name in _REQUEST_KINDS if name.startswith(_RESERVED_PREFIX))
)
"""Triton's answer to a request parameter in its reserved space that it does not read."""

_SHM_REGION = "shared_memory_region"
_SHM_OFFSET = "shared_memory_offset"
_SHM_SIZE = "shared_memory_byte_size"
_SHM_KINDS = (
    (_SHM_REGION, "string_param"),
    (_SHM_OFFSET, "int64_param"),
    (_SHM_SIZE, "int64_param"),
)


def parameter_value(name: str, parameter: Message) -> Any:
    """The Python value of an ``InferParameter`` (or a repository parameter)."""
    which = parameter.WhichOneof(_CHOICE)
    if which is None:
        raise InvalidInput(f"invalid value type for '{name}' parameter: no value is set")
    return getattr(parameter, which)


def request_parameter(name: str, parameter: Message) -> Any:
    """The value of the request parameter ``name``, in the kind Triton takes for it.

    An ``int64_param`` correlation id or timeout is read as Triton's core holds it, an
    unsigned 64-bit integer (-1 is 2^64-1); a negative ``int64_param`` priority is refused,
    and so is a name starting with ``triton_`` that Triton does not read."""
    kinds = _REQUEST_KINDS.get(name)
    if kinds is None:
        if name.startswith(_RESERVED_PREFIX):
            raise InvalidInput(_RESERVED)
        return parameter_value(name, parameter)
    which = parameter.WhichOneof(_CHOICE)
    if which not in kinds:
        raise InvalidInput(
            f"invalid value type for '{name}' parameter, expected {' or '.join(kinds)}."
        )
    value = getattr(parameter, which)
    if which == "int64_param" and value < 0:
        if name in ("sequence_id", "timeout"):
            return value + _UINT64
        if name == "priority":
            raise InvalidInput("invalid value for 'priority', expected value >= 0.")
    return value


def class_count(parameter: Message) -> int:
    """A requested output's ``classification`` parameter: a positive ``int64_param``. (A
    count past 2^32-1 is refused by the shared parser, where Triton would truncate it.)"""
    if parameter.WhichOneof(_CHOICE) != "int64_param":
        raise InvalidInput(
            "invalid value type for 'classification' parameter, expected int64_param"
        )
    count: int = parameter.int64_param
    if count <= 0:
        raise InvalidInput("invalid value for 'classification' parameter, expected >= 1")
    return count


def shared_memory_parameters(tensor: str, parameters: Any) -> dict[str, Any]:
    """The shared memory parameters of the input or requested output ``tensor``, checked as
    Triton's gRPC frontend checks them (``ParseSharedMemoryParams``), in its order: the
    region a ``string_param``; offset and byte size ``int64_param`` (``uint64_param``
    refused too) and only with a region; the byte size always with it. Only these names are
    looked up, not the whole map read."""
    if not parameters:
        return {}
    found: dict[str, Any] = {}
    for name, kind in _SHM_KINDS:
        if name not in parameters:
            continue
        if name != _SHM_REGION and _SHM_REGION not in found:
            raise InvalidInput(without_region(name, tensor))
        parameter = parameters[name]
        if parameter.WhichOneof(_CHOICE) != kind:
            raise InvalidInput(
                f"invalid value type for '{name}' parameter for tensor '{tensor}', expected {kind}."
            )
        found[name] = getattr(parameter, kind)
    if found and _SHM_SIZE not in found:
        raise InvalidInput(without_size(tensor))
    return found
