"""The ``outputs`` a request asks for: names, binary or JSON, shared memory, and the
classification extension's class counts."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sluice.core.classification import CLASSIFIABLE, unsupported_message
from sluice.core.errors import InvalidInput
from sluice.core.fields import json_type
from sluice.gateway.inference.fields import tensor_entry
from sluice.gateway.inference.json_parameters import (
    NON_BOOLEAN,
    NON_UNSIGNED,
    is_uint64,
    unparsable,
)
from sluice.gateway.inference.pending_input import ShmParameters
from sluice.gateway.inference.request import RequestedOutput, RequestLimits
from sluice.gateway.inference.request_errors import log_request
from sluice.gateway.shm.references import SHM_REGION, RegionLookup, parse_shm_parameters

if TYPE_CHECKING:
    from sluice.core.config import ModelConfig, TensorSpec


_MAX_CLASSES = (1 << 32) - 1  # Triton keeps the count in a uint32
_CLASSIFICATION = "classification"
_BINARY = "binary_data"


def parse_outputs(
    value: Any,
    config: ModelConfig,
    binary_output: bool | None,
    limits: RequestLimits,
    regions: RegionLookup,
    request_id: str,
) -> tuple[list[RequestedOutput], dict[str, int] | None]:
    """The requested outputs, and the class count of each output asked to classify.
    ``binary_output``: the request's ``binary_data_output`` (None: not given, JSON)."""
    binary_default = bool(binary_output)
    json_default = binary_output is False
    if value is None or (isinstance(value, list) and not value):
        return [
            RequestedOutput(spec.name, binary_default, json_asked=json_default)
            for spec in config.outputs
        ], None
    if not isinstance(value, list):
        raise InvalidInput(f"request 'outputs' must be a list, got {json_type(value)}")
    outputs: list[RequestedOutput] = []
    classes: dict[str, int] | None = None
    seen: set[str] = set()
    for index, entry in enumerate(value):
        item, name = tensor_entry("outputs", index, entry, limits)
        label = f"output '{name}'"
        if name in seen:
            raise InvalidInput(
                f"{log_request(request_id)}output '{name}' already exists in request"
            )
        seen.add(name)
        spec = config.output(name)
        if spec is None:
            expected = ", ".join(f"'{s.name}'" for s in config.outputs)
            raise InvalidInput(
                f"unexpected inference output '{name}' for model '{config.name}'; "
                f"the model's outputs are {expected}"
            )
        binary, json_asked = binary_default, json_default
        shm: ShmParameters | None = None
        count = 0
        parameters = item.get("parameters")
        if parameters is not None:
            if not isinstance(parameters, dict):
                raise InvalidInput(
                    f"{label}: 'parameters' must be an object, got {json_type(parameters)}"
                )
            _check_shm_conflicts(label, parameters)
            if _CLASSIFICATION in parameters:
                count = _classification(label, spec, parameters[_CLASSIFICATION])
            shm = parse_shm_parameters(label, name, parameters)
            if shm is None and _BINARY in parameters:
                flag = parameters[_BINARY]
                if not isinstance(flag, bool):
                    raise InvalidInput(f"{unparsable(_BINARY, NON_BOOLEAN)}; {label}")
                binary, json_asked = flag, not flag
        if shm is None:
            outputs.append(RequestedOutput(name, binary, None, "", count, json_asked))
            if count:
                classes = classes or {}
                classes[name] = count
        else:
            ref = regions.resolve(label, shm.region, shm.offset, shm.byte_size, output=True)
            outputs.append(RequestedOutput(name, False, ref, shm.region))
    return outputs, classes


def _check_shm_conflicts(label: str, parameters: dict[str, Any]) -> None:
    """Triton's first check of an output in shared memory: it asks for no classification,
    and ``binary_data`` (when given) is a boolean, and false."""
    if SHM_REGION not in parameters:
        return
    if _CLASSIFICATION in parameters:
        raise InvalidInput(f"Output can't set both '{SHM_REGION}' and '{_CLASSIFICATION}'; {label}")
    if _BINARY in parameters:
        flag = parameters[_BINARY]
        if not isinstance(flag, bool):
            raise InvalidInput(f"{unparsable(_BINARY, NON_BOOLEAN, 'set')}; {label}")
        if flag:
            raise InvalidInput(
                f"Output can't set both '{SHM_REGION}' and '{_BINARY}'; {label}: an output in "
                f"shared memory (parameters.{SHM_REGION}) cannot also ask for "
                f"parameters.{_BINARY}"
            )


def _classification(label: str, spec: TensorSpec, value: Any) -> int:
    """The requested class count (0: no classification), checked as Triton checks it."""
    if not is_uint64(value):
        raise InvalidInput(f"{unparsable(_CLASSIFICATION, NON_UNSIGNED, 'set')}; {label}")
    if value > _MAX_CLASSES:
        raise InvalidInput(
            f"Unable to set '{_CLASSIFICATION}': {label}: parameters.{_CLASSIFICATION} must be "
            f"an unsigned 32-bit integer, got {value}"
        )
    count: int = value
    if count and spec.datatype not in CLASSIFIABLE:
        raise InvalidInput(f"{unsupported_message(spec.datatype)}; {label}")
    return count
