"""Parse and validate a KServe v2 / Triton HTTP inference request.

The body is a JSON header optionally followed by binary tensor data (Triton's
binary tensor data extension); ``Inference-Header-Content-Length`` gives the
header length. Every input ends up in Triton's binary layout: binary inputs as
zero-copy slices of the body, JSON ``data`` converted once through numpy.
A header length of 0 is Triton's raw binary request: the whole body is the
single input's bytes. An input or output may instead live in a registered shared
memory region (Triton's system shared memory extension): its reference is checked
against the region here, and the tensor carries the resolved location, no bytes.

Every problem raises :class:`~sluice.errors.InvalidInput` with a message that
names the offending field. Checks run cheapest first: the request's structure,
input names, datatypes and shapes, requested outputs, then the tensor data.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import orjson

from gateway.json_tensors import fmt_shape, json_to_buffer, json_type
from sluice.datatypes import (
    BYTES,
    DATATYPES,
    ELEMENT_SIZE,
    count_bytes_elements,
    element_count,
)
from sluice.errors import InvalidInput
from sluice.wire import ShmRef

if TYPE_CHECKING:
    from sluice.config import ModelConfig, TensorSpec

_MAX_DIM = (1 << 63) - 1
_MAX_BYTES_ELEMENT = (1 << 32) - 1
_LENGTH = struct.Struct("<I")
_RESERVED_PREFIX = "triton_"
_SHM_REGION = "shared_memory_region"
_SHM_SIZE = "shared_memory_byte_size"
_SHM_OFFSET = "shared_memory_offset"
_BINARY_SIZE = "binary_data_size"
_DATATYPE_LIST = ", ".join(sorted(DATATYPES))


class RegionLookup(Protocol):
    """The shared memory regions requests may reference (the gateway's registry)."""

    def resolve(self, label: str, name: str, offset: int, byte_size: int) -> ShmRef: ...

    def mapped(
        self, label: str, region: str, ref: ShmRef
    ) -> AbstractContextManager[memoryview]: ...


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

    @property
    def regions(self) -> list[str]:
        """Names of the shared memory regions the request references."""
        names = [t.region for t in self.inputs if t.region]
        return names + [o.region for o in self.outputs if o.region]


@dataclass(frozen=True, slots=True)
class RequestLimits:
    max_elements: int = 1 << 26  # per input tensor
    max_json_depth: int = 32  # nesting of JSON `data`
    max_inputs: int = 256
    max_string_length: int = 1 << 16  # names / id length


DEFAULT_LIMITS = RequestLimits()


class _NoRegions:
    def resolve(self, label: str, name: str, offset: int, byte_size: int) -> ShmRef:
        raise InvalidInput(f"{label}: unknown shared memory region '{name}'")

    def mapped(
        self, label: str, region: str, ref: ShmRef
    ) -> AbstractContextManager[memoryview]:  # pragma: no cover - resolve raised first
        raise InvalidInput(f"{label}: unknown shared memory region '{region}'")


@dataclass(frozen=True, slots=True)
class _ShmParameters:
    region: str
    offset: int
    byte_size: int


@dataclass(slots=True)
class _Pending:
    """An input whose header passed the structural checks; data not yet read."""

    label: str
    name: str
    datatype: str
    shape: tuple[int, ...]
    data: Any  # the JSON `data` value, or None for binary inputs
    binary_size: int | None
    shm: _ShmParameters | None = None
    spec: TensorSpec | None = None
    count: int = 0


def parse_infer_request(
    body: bytes | bytearray | memoryview,
    header_length: int | None,
    config: ModelConfig,
    limits: RequestLimits = DEFAULT_LIMITS,
    regions: RegionLookup | None = None,
) -> InferRequest:
    """Validate ``body`` against ``config`` and return the decoded request.

    ``regions`` resolves shared memory references (none are registered when None).
    """
    lookup: RegionLookup = regions if regions is not None else _NoRegions()
    view = memoryview(body)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    size = len(view)
    if header_length is not None:
        if isinstance(header_length, bool) or not isinstance(header_length, int):
            raise InvalidInput("Inference-Header-Content-Length must be an integer")
        if not 0 <= header_length <= size:
            raise InvalidInput(
                f"Inference-Header-Content-Length {header_length} is outside the "
                f"request body of {size} bytes"
            )
        if header_length == 0:
            return _parse_raw(view, config, limits)
        header, binary = view[:header_length], view[header_length:]
    else:
        header, binary = view, view[size:]

    try:
        doc = orjson.loads(header)
    except orjson.JSONDecodeError as exc:
        raise InvalidInput(f"malformed request body: {exc}") from None
    if not isinstance(doc, dict):
        raise InvalidInput(f"malformed request body: expected a JSON object, got {json_type(doc)}")

    request_id = _parse_id(doc.get("id"), limits)
    parameters, binary_default = _parse_request_parameters(doc.get("parameters"))
    pending = _parse_input_headers(doc.get("inputs"), config, limits)
    batch_size = _check_input_specs(pending, config, limits)
    outputs = _parse_outputs(doc.get("outputs"), config, binary_default, limits, lookup)
    inputs = _read_input_data(pending, binary, header_length is None, limits, lookup)
    return InferRequest(
        id=request_id,
        inputs=inputs,
        outputs=outputs,
        parameters=parameters,
        batch_size=batch_size,
    )


# --------------------------------------------------------------------- request


def _parse_id(value: Any, limits: RequestLimits) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise InvalidInput(f"request 'id' must be a string, got {json_type(value)}")
    if len(value) > limits.max_string_length:
        raise InvalidInput(f"request 'id' is longer than {limits.max_string_length} characters")
    return value


def _parse_request_parameters(value: Any) -> tuple[dict[str, Any], bool]:
    if value is None:
        return {}, False
    if not isinstance(value, dict):
        raise InvalidInput(f"request 'parameters' must be an object, got {json_type(value)}")
    parameters: dict[str, Any] = {}
    binary_default = False
    for key, item in value.items():
        if key.startswith(_RESERVED_PREFIX):
            raise InvalidInput(
                f"request parameter '{key}' is reserved "
                f"(names starting with '{_RESERVED_PREFIX}' are reserved)"
            )
        if not isinstance(item, str | int | float):  # bool is an int
            raise InvalidInput(
                f"request parameter '{key}' must be a string, number or boolean, "
                f"got {json_type(item)}"
            )
        if key == "binary_data_output":
            if not isinstance(item, bool):
                raise InvalidInput(
                    f"request parameter 'binary_data_output' must be a boolean, "
                    f"got {json_type(item)}"
                )
            binary_default = item
        else:
            parameters[key] = item
    return parameters, binary_default


# ---------------------------------------------------------------------- inputs


def _parse_input_headers(value: Any, config: ModelConfig, limits: RequestLimits) -> list[_Pending]:
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

    pending: list[_Pending] = []
    for index, item in enumerate(value):
        if not isinstance(item, dict):
            raise InvalidInput(f"inputs[{index}] must be an object, got {json_type(item)}")
        name = item.get("name")
        if not isinstance(name, str):
            if name is None:
                raise InvalidInput(f"inputs[{index}]: 'name' is required")
            raise InvalidInput(f"inputs[{index}]: 'name' must be a string, got {json_type(name)}")
        if len(name) > limits.max_string_length:
            raise InvalidInput(
                f"inputs[{index}]: 'name' is longer than {limits.max_string_length} characters"
            )
        label = f"input '{name}'"
        shape = _parse_shape(label, item.get("shape"))
        datatype = item.get("datatype")
        if not isinstance(datatype, str) or datatype not in DATATYPES:
            shown = datatype if isinstance(datatype, str) else json_type(datatype)
            if datatype is None:
                raise InvalidInput(f"{label}: 'datatype' is required")
            raise InvalidInput(
                f"{label}: unknown datatype {shown!r}; expected one of {_DATATYPE_LIST}"
            )
        binary_size, shm = _parse_input_parameters(label, item.get("parameters"))
        data = item.get("data")
        if shm is not None:
            if data is not None or binary_size is not None:
                raise InvalidInput(
                    f"{label}: an input in shared memory (parameters.{_SHM_REGION}) must not "
                    "also carry 'data' or 'parameters.binary_data_size'"
                )
        elif (data is None) == (binary_size is None):
            which = "both" if data is not None else "neither"
            raise InvalidInput(
                f"{label}: exactly one of 'data' or 'parameters.binary_data_size' "
                f"must be given, got {which}"
            )
        pending.append(_Pending(label, name, datatype, shape, data, binary_size, shm))

    seen: set[str] = set()
    for entry in pending:
        spec = config.input(entry.name)
        if spec is None:
            expected = ", ".join(f"'{s.name}'" for s in config.inputs)
            raise InvalidInput(
                f"{entry.label}: unknown input for model '{config.name}'; "
                f"expected one of: {expected}"
            )
        if entry.name in seen:
            raise InvalidInput(f"{entry.label}: given more than once")
        seen.add(entry.name)
        entry.spec = spec

    missing = [s.name for s in config.inputs if not s.optional and s.name not in seen]
    if missing:
        names = ", ".join(f"'{name}'" for name in missing)
        raise InvalidInput(f"missing required input(s) {names} for model '{config.name}'")
    return pending


def _parse_shape(label: str, value: Any) -> tuple[int, ...]:
    if value is None:
        raise InvalidInput(f"{label}: 'shape' is required")
    if not isinstance(value, list):
        raise InvalidInput(f"{label}: 'shape' must be a list, got {json_type(value)}")
    for index, dim in enumerate(value):
        if isinstance(dim, bool) or not isinstance(dim, int) or not 0 <= dim <= _MAX_DIM:
            shown = dim if isinstance(dim, int) and not isinstance(dim, bool) else json_type(dim)
            raise InvalidInput(
                f"{label}: 'shape' dim {index} must be a non-negative integer, got {shown}"
            )
    return tuple(value)


def _parse_input_parameters(label: str, value: Any) -> tuple[int | None, _ShmParameters | None]:
    """The input's binary_data_size and shared memory reference (None when absent)."""
    if value is None:
        return None, None
    if not isinstance(value, dict):
        raise InvalidInput(f"{label}: 'parameters' must be an object, got {json_type(value)}")
    shm = _parse_shm_parameters(label, value)
    size = value.get(_BINARY_SIZE)
    if size is None:
        return None, shm
    return _natural_parameter(label, _BINARY_SIZE, size), shm


def _parse_shm_parameters(label: str, parameters: dict[str, Any]) -> _ShmParameters | None:
    """Triton's rules: region and byte size go together, the offset is optional (0)."""
    if not (_SHM_REGION in parameters or _SHM_SIZE in parameters or _SHM_OFFSET in parameters):
        return None
    region, size = parameters.get(_SHM_REGION), parameters.get(_SHM_SIZE)
    if region is None or size is None:
        raise InvalidInput(
            f"{label}: parameters.{_SHM_REGION} and parameters.{_SHM_SIZE} must be given together"
        )
    if not isinstance(region, str) or not region:
        shown = "empty" if region == "" else json_type(region)
        raise InvalidInput(
            f"{label}: parameters.{_SHM_REGION} must be a non-empty string, got {shown}"
        )
    return _ShmParameters(
        region,
        _natural_parameter(label, _SHM_OFFSET, parameters.get(_SHM_OFFSET, 0)),
        _natural_parameter(label, _SHM_SIZE, size),
    )


def _natural_parameter(label: str, name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        shown = value if isinstance(value, int) and not isinstance(value, bool) else None
        raise InvalidInput(
            f"{label}: parameters.{name} must be a non-negative integer, "
            f"got {shown if shown is not None else json_type(value)}"
        )
    return value


def _check_input_specs(pending: list[_Pending], config: ModelConfig, limits: RequestLimits) -> int:
    """Datatypes, shapes, batch sizes and element limits; returns the batch size."""
    max_batch = config.max_batch_size
    batch: int | None = None
    batch_from = ""
    for entry in pending:
        spec = entry.spec
        assert spec is not None
        if entry.datatype != spec.datatype:
            raise InvalidInput(
                f"{entry.label}: expected datatype {spec.datatype}, got {entry.datatype}"
            )
        item_batch = _check_shape(entry.label, entry.shape, spec.dims, max_batch)
        if item_batch is not None:
            if batch is None:
                batch, batch_from = item_batch, entry.name
            elif item_batch != batch:
                raise InvalidInput(
                    f"{entry.label}: batch size {item_batch} does not match batch size "
                    f"{batch} of input '{batch_from}'"
                )
        entry.count = element_count(entry.shape)
        if entry.count > limits.max_elements:
            raise InvalidInput(
                f"{entry.label}: shape {fmt_shape(entry.shape)} has {entry.count} elements, "
                f"more than the limit of {limits.max_elements}"
            )
    return 1 if batch is None else batch


def _check_shape(
    label: str, shape: tuple[int, ...], dims: Sequence[int], max_batch: int
) -> int | None:
    """Check ``shape`` against the model dims; returns the batch size when batching."""
    expected = (-1, *dims) if max_batch > 0 else tuple(dims)
    if len(shape) != len(expected):
        raise InvalidInput(
            f"{label}: shape {fmt_shape(shape)} does not match model shape {fmt_shape(expected)} "
            f"(expected {len(expected)} dims, got {len(shape)})"
        )
    batch: int | None = None
    first = 0
    if max_batch > 0:
        batch = shape[0]
        if batch < 1:
            raise InvalidInput(f"{label}: batch size must be at least 1, got {batch}")
        if batch > max_batch:
            raise InvalidInput(f"{label}: batch size {batch} exceeds max_batch_size {max_batch}")
        first = 1
    for index in range(first, len(shape)):
        want = expected[index]
        if want != -1 and shape[index] != want:
            raise InvalidInput(
                f"{label}: shape {fmt_shape(shape)} does not match model shape "
                f"{fmt_shape(expected)} (dim {index} must be {want})"
            )
    return batch


# --------------------------------------------------------------------- outputs


def _parse_outputs(
    value: Any,
    config: ModelConfig,
    binary_default: bool,
    limits: RequestLimits,
    regions: RegionLookup,
) -> list[RequestedOutput]:
    if value is None or (isinstance(value, list) and not value):
        return [RequestedOutput(spec.name, binary_default) for spec in config.outputs]
    if not isinstance(value, list):
        raise InvalidInput(f"request 'outputs' must be a list, got {json_type(value)}")
    outputs: list[RequestedOutput] = []
    seen: set[str] = set()
    for index, item in enumerate(value):
        if not isinstance(item, dict):
            raise InvalidInput(f"outputs[{index}] must be an object, got {json_type(item)}")
        name = item.get("name")
        if not isinstance(name, str):
            if name is None:
                raise InvalidInput(f"outputs[{index}]: 'name' is required")
            raise InvalidInput(f"outputs[{index}]: 'name' must be a string, got {json_type(name)}")
        if len(name) > limits.max_string_length:
            raise InvalidInput(
                f"outputs[{index}]: 'name' is longer than {limits.max_string_length} characters"
            )
        label = f"output '{name}'"
        if config.output(name) is None:
            expected = ", ".join(f"'{s.name}'" for s in config.outputs)
            raise InvalidInput(
                f"{label}: unknown output for model '{config.name}'; expected one of: {expected}"
            )
        if name in seen:
            raise InvalidInput(f"{label}: requested more than once")
        seen.add(name)
        binary = binary_default
        shm: _ShmParameters | None = None
        parameters = item.get("parameters")
        if parameters is not None:
            if not isinstance(parameters, dict):
                raise InvalidInput(
                    f"{label}: 'parameters' must be an object, got {json_type(parameters)}"
                )
            shm = _parse_shm_parameters(label, parameters)
            classes = parameters.get("classification")
            if classes is not None:
                if isinstance(classes, bool) or not isinstance(classes, int) or classes < 0:
                    raise InvalidInput(
                        f"{label}: parameters.classification must be a non-negative integer, "
                        f"got {json_type(classes)}"
                    )
                if classes:
                    raise InvalidInput(f"{label}: classification is not supported yet")
            flag = parameters.get("binary_data")
            if flag is not None:
                if not isinstance(flag, bool):
                    raise InvalidInput(
                        f"{label}: parameters.binary_data must be a boolean, got {json_type(flag)}"
                    )
                binary = flag
                if flag and shm is not None:
                    raise InvalidInput(
                        f"{label}: an output in shared memory (parameters.{_SHM_REGION}) "
                        "cannot also ask for parameters.binary_data"
                    )
        if shm is None:
            outputs.append(RequestedOutput(name, binary))
        else:
            ref = regions.resolve(label, shm.region, shm.offset, shm.byte_size)
            outputs.append(RequestedOutput(name, False, ref, shm.region))
    return outputs


# ------------------------------------------------------------------------ data


def _read_input_data(
    pending: list[_Pending],
    binary: memoryview,
    no_header: bool,
    limits: RequestLimits,
    regions: RegionLookup,
) -> list[InputTensor]:
    inputs: list[InputTensor] = []
    offset = 0
    available = len(binary)
    for entry in pending:
        if entry.shm is not None:
            inputs.append(_shm_input(entry, entry.shm, regions))
            continue
        if entry.binary_size is None:
            data = json_to_buffer(
                entry.label,
                entry.datatype,
                entry.shape,
                entry.count,
                entry.data,
                limits.max_json_depth,
            )
        else:
            data = _slice_binary(entry, binary, offset, no_header)
            offset += entry.binary_size
        inputs.append(InputTensor(entry.name, entry.datatype, entry.shape, data))
    if offset != available:
        raise InvalidInput(
            f"request body has {available - offset} bytes after the JSON header that no "
            "input's parameters.binary_data_size accounts for"
        )
    return inputs


def _slice_binary(entry: _Pending, binary: memoryview, offset: int, no_header: bool) -> memoryview:
    size = entry.binary_size
    assert size is not None
    element_size = ELEMENT_SIZE.get(entry.datatype)
    if element_size is not None and size != entry.count * element_size:
        raise InvalidInput(
            f"{entry.label}: parameters.binary_data_size is {size} but shape "
            f"{fmt_shape(entry.shape)} of {entry.datatype} needs {entry.count * element_size} bytes"
        )
    left = len(binary) - offset
    if size > left:
        hint = (
            " (binary data needs the Inference-Header-Content-Length header)" if no_header else ""
        )
        raise InvalidInput(
            f"{entry.label}: parameters.binary_data_size {size} exceeds the {left} bytes "
            f"of binary data left in the request body{hint}"
        )
    chunk = binary[offset : offset + size]
    if element_size is None:
        try:
            found = count_bytes_elements(chunk)
        except InvalidInput as exc:
            raise InvalidInput(f"{entry.label}: {exc.message}") from None
        if found != entry.count:
            raise InvalidInput(
                f"{entry.label}: shape {fmt_shape(entry.shape)} needs {entry.count} elements, "
                f"got {found}"
            )
    return chunk


def _shm_input(entry: _Pending, shm: _ShmParameters, regions: RegionLookup) -> InputTensor:
    label = entry.label
    element_size = ELEMENT_SIZE.get(entry.datatype)
    if element_size is not None and shm.byte_size != entry.count * element_size:
        raise InvalidInput(
            f"{label}: parameters.{_SHM_SIZE} is {shm.byte_size} but shape "
            f"{fmt_shape(entry.shape)} of {entry.datatype} needs {entry.count * element_size} bytes"
        )
    ref = regions.resolve(label, shm.region, shm.offset, shm.byte_size)
    if element_size is None:
        with regions.mapped(label, shm.region, ref) as view:
            try:
                found = count_bytes_elements(view)
            except InvalidInput as exc:
                raise InvalidInput(f"{label}: region '{shm.region}': {exc.message}") from None
        if found != entry.count:
            raise InvalidInput(
                f"{label}: the {shm.byte_size} bytes at offset {shm.offset} of region "
                f"'{shm.region}' hold {found} BYTES elements, shape {fmt_shape(entry.shape)} "
                f"needs {entry.count}"
            )
    return InputTensor(entry.name, entry.datatype, entry.shape, b"", ref, shm.region)


# ------------------------------------------------------------------ raw binary


def _parse_raw(view: memoryview, config: ModelConfig, limits: RequestLimits) -> InferRequest:
    """Triton's raw binary request: the whole body is the single input's data."""
    prefix = "raw binary request (Inference-Header-Content-Length: 0)"
    if len(config.inputs) != 1:
        raise InvalidInput(
            f"{prefix} needs a model with exactly one input; model '{config.name}' has "
            f"{len(config.inputs)}"
        )
    spec = config.inputs[0]
    label = f"input '{spec.name}'"
    dims = tuple(spec.dims)
    batched = config.max_batch_size > 0
    size = len(view)
    data: bytes | memoryview
    if spec.datatype == BYTES:
        if dims not in ((1,), (-1,)):
            raise InvalidInput(
                f"{prefix}: BYTES {label} must have model shape [1], got {fmt_shape(dims)}"
            )
        if size > _MAX_BYTES_ELEMENT:
            raise InvalidInput(f"{prefix}: {label} element is longer than 2^32-1 bytes")
        shape: tuple[int, ...] = (1, 1) if batched else (1,)
        data = b"".join((_LENGTH.pack(size), view))
    else:
        element_size = ELEMENT_SIZE[spec.datatype]
        variable = [index for index, dim in enumerate(dims) if dim == -1]
        if len(variable) > 1:
            raise InvalidInput(
                f"{prefix}: the shape of {label} cannot be deduced because model shape "
                f"{fmt_shape(dims)} has more than one variable-size dim"
            )
        item_bytes = element_size * element_count([d for d in dims if d != -1])
        resolved = list(dims)
        if variable:
            if item_bytes == 0:
                if size:
                    raise InvalidInput(
                        f"{prefix}: {label} with model shape {fmt_shape(dims)} holds no data, "
                        f"got {size} bytes"
                    )
                resolved[variable[0]] = 0
            elif size % item_bytes:
                raise InvalidInput(
                    f"{prefix}: body of {size} bytes is not a whole number of "
                    f"{spec.datatype} {label} items of model shape {fmt_shape(dims)}"
                )
            else:
                resolved[variable[0]] = size // item_bytes
        elif size != item_bytes:
            raise InvalidInput(
                f"{prefix}: {label} of shape {fmt_shape(dims)} needs {item_bytes} bytes of "
                f"{spec.datatype}, got {size}"
            )
        shape = (1, *resolved) if batched else tuple(resolved)
        data = view
    count = element_count(shape)
    if count > limits.max_elements:
        raise InvalidInput(
            f"{label}: shape {fmt_shape(shape)} has {count} elements, more than the limit of "
            f"{limits.max_elements}"
        )
    return InferRequest(
        id="",
        inputs=[InputTensor(spec.name, spec.datatype, shape, data)],
        outputs=[RequestedOutput(output.name, True) for output in config.outputs],
        parameters={},
        batch_size=1,
    )
