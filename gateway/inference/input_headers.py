"""The ``inputs`` of a request: structure, names, datatypes, duplicates and missing
inputs, in Triton's order; no tensor data is read here."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sluice.core.datatypes import DATATYPES
from sluice.core.errors import InvalidInput
from sluice.core.fields import json_type
from sluice.gateway.inference.fields import check_size_fits, parse_shape, tensor_entry
from sluice.gateway.inference.json_parameters import uint64_parameter
from sluice.gateway.inference.pending_input import PendingInput, ShmParameters
from sluice.gateway.inference.request import RequestLimits
from sluice.gateway.inference.request_errors import input_count_message, log_request
from sluice.gateway.shm.references import SHM_REGION, parse_shm_parameters

if TYPE_CHECKING:
    from sluice.core.config import ModelConfig


BINARY_SIZE = "binary_data_size"


_DATATYPE_LIST = ", ".join(sorted(DATATYPES))

_CONTENT = (
    f"Input must set only one of the following fields: 'data', '{BINARY_SIZE}' in "
    f"'parameters', '{SHM_REGION}' in 'parameters'. But"
)
"""Triton's text for an input that gives its data in none or several ways."""


def parse_input_headers(
    value: Any, config: ModelConfig, limits: RequestLimits, request_id: str
) -> list[PendingInput]:
    """Structure, names, duplicates and missing inputs (no data is read)."""
    if value is None:
        raise InvalidInput("request 'inputs' is required")
    if not isinstance(value, list):
        raise InvalidInput(f"request 'inputs' must be a list, got {json_type(value)}")
    if not value:
        raise InvalidInput("request 'inputs' must not be empty")
    if len(value) > limits.max_inputs:
        raise InvalidInput(
            f"request 'inputs' has {len(value)} entries, more than the limit of {limits.max_inputs}"
        )

    pending: list[PendingInput] = []
    seen: set[str] = set()
    for index, entry in enumerate(value):
        item, name = tensor_entry("inputs", index, entry, limits)
        if name in seen:
            raise InvalidInput(f"{log_request(request_id)}input '{name}' already exists in request")
        seen.add(name)
        label = f"input '{name}'"
        shape = parse_shape(label, item.get("shape"))
        datatype = item.get("datatype")
        if not isinstance(datatype, str) or datatype not in DATATYPES:
            shown = datatype if isinstance(datatype, str) else json_type(datatype)
            if datatype is None:
                raise InvalidInput(f"{label}: 'datatype' is required")
            raise InvalidInput(
                f"{label}: unknown datatype {shown!r}; expected one of {_DATATYPE_LIST}"
            )
        check_size_fits(name, shape, datatype)
        data = item.get("data")
        binary_size, shm = parse_input_parameters(
            label, name, item.get("parameters"), data is not None
        )
        pending.append(PendingInput(label, name, datatype, shape, data, binary_size, shm))

    # Triton checks the input count first, then each name (core InferenceRequest::Normalize).
    missing = [s.name for s in config.inputs if not s.optional and s.name not in seen]
    if missing or len(pending) > len(config.inputs):
        required = len(config.inputs) - sum(s.optional for s in config.inputs)
        if not required <= len(pending) <= len(config.inputs):
            raise InvalidInput(input_count_message(config, pending, missing, request_id))
    for entry in pending:
        spec = config.input(entry.name)
        if spec is None:
            expected = ", ".join(f"'{s.name}'" for s in config.inputs)
            raise InvalidInput(
                f"unexpected inference input '{entry.name}' for model '{config.name}'; "
                f"the model's inputs are {expected}"
            )
        entry.spec = spec
    if missing:  # the count fits but optional inputs stand in for required ones
        raise InvalidInput(input_count_message(config, pending, missing, request_id))
    return pending


def parse_input_parameters(
    label: str, name: str, value: Any, has_data: bool
) -> tuple[int | None, ShmParameters | None]:
    """The input's binary_data_size and shared memory reference (None when absent), read as
    Triton's HTTP frontend reads them: first which of ``data``, ``binary_data_size`` and
    ``shared_memory_region`` the input gives (exactly one), then their values."""
    if value is None:
        value = {}
    elif not isinstance(value, dict):
        raise InvalidInput(f"{label}: 'parameters' must be an object, got {json_type(value)}")
    has_binary = BINARY_SIZE in value
    has_shm = SHM_REGION in value
    if has_data + has_binary + has_shm != 1:
        given = [
            field
            for field, present in (
                ("'data'", has_data),
                (f"'{BINARY_SIZE}'", has_binary),
                (f"'{SHM_REGION}'", has_shm),
            )
            if present
        ]
        found = f" set {' '.join(given)}" if given else " no field is set"
        raise InvalidInput(f"{_CONTENT}{found}; {label}")
    size = uint64_parameter(BINARY_SIZE, value[BINARY_SIZE], f"; {label}") if has_binary else None
    shm = parse_shm_parameters(label, name, value) if value else None
    return size, shm
