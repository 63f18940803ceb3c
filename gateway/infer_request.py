"""Parse and validate a KServe v2 / Triton HTTP inference request.

The body is a JSON header optionally followed by binary tensor data (Triton's
binary tensor data extension); ``Inference-Header-Content-Length`` gives the
header length. Every input ends up in Triton's binary layout: binary inputs as
zero-copy slices of the body, JSON ``data`` converted once through numpy.
A header length of 0 is Triton's raw binary request: the whole body is the
single input's bytes. An input or output may instead live in a registered shared
memory region (Triton's system shared memory extension): its reference is checked
against the region here, and the tensor carries the resolved location, no bytes.

Every problem raises :class:`~sluice.core.errors.InvalidInput` with a message that
names the offending field. Checks run cheapest first: the request's structure,
input names, datatypes and shapes, requested outputs, then the tensor data. Where
Triton refuses the same request, the message starts with Triton's own text (core
``src/infer_request.cc``, ``src/model.cc``; server ``src/http_server.cc``), including
its ``[request id: <id>]`` prefix, so that clients matching on it keep working; Sluice's
own detail follows after ``"; "``.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import orjson

from sluice.core.classification import CLASSIFIABLE, unsupported_message
from sluice.core.datatypes import (
    BYTES,
    DATATYPES,
    ELEMENT_SIZE,
    count_bytes_elements,
    element_count,
)
from sluice.core.errors import InvalidInput
from sluice.core.fields import json_type
from sluice.core.wire import ShmRef
from sluice.gateway.json_tensors import BytesCountMismatch, fmt_shape, json_to_buffer

if TYPE_CHECKING:
    from sluice.core.config import ModelConfig, TensorSpec

_MAX_DIM = (1 << 63) - 1
_MAX_BYTES_ELEMENT = (1 << 32) - 1
_MAX_CLASSES = (1 << 32) - 1  # Triton keeps the count in a uint32
_LENGTH = struct.Struct("<I")
_RESERVED_PREFIX = "triton_"
_TRITON_PARAMETERS = frozenset({"triton_enable_empty_final_response"})
"""Reserved names Triton's frontends read themselves (gRPC streams of decoupled models)."""
_SHM_REGION = "shared_memory_region"
_SHM_SIZE = "shared_memory_byte_size"
_SHM_OFFSET = "shared_memory_offset"
_BINARY_SIZE = "binary_data_size"
_DATATYPE_LIST = ", ".join(sorted(DATATYPES))


class RegionLookup(Protocol):
    """The shared memory regions requests may reference (the gateway's registry)."""

    def resolve(
        self, label: str, name: str, offset: int, byte_size: int, *, output: bool = False
    ) -> ShmRef: ...

    def read(self, label: str, region: str, ref: ShmRef) -> memoryview: ...


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


DEFAULT_LIMITS = RequestLimits()


class _NoRegions:
    def resolve(
        self, label: str, name: str, offset: int, byte_size: int, *, output: bool = False
    ) -> ShmRef:
        raise InvalidInput(f"{label}: unknown shared memory region '{name}'")

    def read(self, label: str, region: str, ref: ShmRef) -> memoryview:  # pragma: no cover
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
    return parse_infer_document(doc, binary, config, limits, lookup, header_length is None)


def parse_infer_document(
    doc: dict[str, Any],
    binary: memoryview,
    config: ModelConfig,
    limits: RequestLimits = DEFAULT_LIMITS,
    regions: RegionLookup | None = None,
    no_header: bool = False,
) -> InferRequest:
    """Validate a request already decoded into the JSON form (``doc``) whose binary inputs
    lie one after the other in ``binary``: the JSON body's header and the gRPC message
    (see :mod:`gateway.grpc_api.tensors`) both end here, so both are checked the same way.
    ``no_header``: the body came without Inference-Header-Content-Length (for the hint)."""
    lookup: RegionLookup = regions if regions is not None else _NoRegions()
    request_id = _parse_id(doc.get("id"), limits)
    parameters, binary_default = _parse_request_parameters(doc.get("parameters"))
    pending = _parse_input_headers(doc.get("inputs"), config, limits, request_id)
    outputs, classes = _parse_outputs(
        doc.get("outputs"), config, binary_default, limits, lookup, request_id
    )
    batch_size = _check_input_specs(pending, config, limits, request_id)
    inputs = _read_input_data(pending, binary, no_header, limits, lookup, config, request_id)
    return InferRequest(
        id=request_id,
        inputs=inputs,
        outputs=outputs,
        parameters=parameters,
        batch_size=batch_size,
        classes=classes,
    )


def log_request(request_id: str) -> str:
    """Triton's prefix of the errors its core raises about a request (``LogRequest()``)."""
    return f"[request id: {request_id or '<id_unknown>'}] "


def _names(names: Sequence[str]) -> str:
    """A name list as Triton writes it: ``['a','b']``."""
    return "[" + ",".join(f"'{name}'" for name in names) + "]"


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
        if key in _TRITON_PARAMETERS:
            if not isinstance(item, bool):
                raise InvalidInput(f"request parameter '{key}' must be a boolean")
        elif key.startswith(_RESERVED_PREFIX):
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


def _parse_input_headers(
    value: Any, config: ModelConfig, limits: RequestLimits, request_id: str
) -> list[_Pending]:
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
    seen: set[str] = set()
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
        if name in seen:
            raise InvalidInput(f"{log_request(request_id)}input '{name}' already exists in request")
        seen.add(name)
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

    # Triton checks the input count first, then each name (core InferenceRequest::Normalize).
    missing = [s.name for s in config.inputs if not s.optional and s.name not in seen]
    if missing or len(pending) > len(config.inputs):
        required = len(config.inputs) - sum(s.optional for s in config.inputs)
        if not required <= len(pending) <= len(config.inputs):
            raise InvalidInput(_input_count_message(config, pending, missing, request_id))
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
        raise InvalidInput(_input_count_message(config, pending, missing, request_id))
    return pending


def _input_count_message(
    config: ModelConfig, pending: list[_Pending], missing: list[str], request_id: str
) -> str:
    """Triton's text (``ValidateRequestInputs``), with ``[]`` where Triton prints ``]``
    when nothing is missing."""
    total = len(config.inputs)
    required = total - sum(s.optional for s in config.inputs)
    expected = (
        f"expected {total} inputs"
        if required == total
        else f"expected number of inputs between {required} and {total}"
    )
    return (
        f"{log_request(request_id)}{expected} but got {len(pending)} inputs for model "
        f"'{config.name}'. "
        f"Got input(s) {_names([e.name for e in pending])}, but missing required input(s) "
        f"{_names(missing)}. Please provide all required input(s)."
    )


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


_BATCH_NOTE = (
    "NOTE: Setting a non-zero max_batch_size in the model config requires a batch dimension "
    "to be prepended to each input shape. If you want to specify the full shape including "
    "the batch dim in your input dims config, try setting max_batch_size to zero. See the "
    "model configuration docs for more info on max_batch_size."
)
"""Triton appends this to a shape mismatch for a batching model."""


def _check_input_specs(
    pending: list[_Pending], config: ModelConfig, limits: RequestLimits, request_id: str
) -> int:
    """Batch sizes, datatypes, shapes and element limits; returns the batch size.

    In Triton's order: every input's batch dim first, then the batch limit, then each
    input's datatype and shape."""
    max_batch = config.max_batch_size
    batch: int | None = None
    if max_batch > 0:
        batch_from = ""
        for entry in pending:
            if not entry.shape:
                raise InvalidInput(
                    f"{log_request(request_id)}input '{entry.name}' has no shape but model "
                    f"requires batch dimension for '{config.name}'"
                )
            if batch is None:
                batch, batch_from = entry.shape[0], entry.name
            elif entry.shape[0] != batch:
                raise InvalidInput(
                    f"{log_request(request_id)}input '{entry.name}' batch size does not match "
                    f"other inputs for '{config.name}'; {entry.shape[0]} here, {batch} in "
                    f"input '{batch_from}'"
                )
        assert batch is not None
        if batch > max_batch:
            raise InvalidInput(
                f"{log_request(request_id)}inference request batch-size must be <= {max_batch} for "
                f"'{config.name}'; input '{batch_from}' has batch size {batch}"
            )
        if batch < 1:
            raise InvalidInput(f"{pending[0].label}: batch size must be at least 1, got {batch}")
    first = 1 if max_batch > 0 else 0  # the model's dims start after the batch dim
    for entry in pending:
        spec = entry.spec
        assert spec is not None
        if entry.datatype != spec.datatype:
            raise InvalidInput(
                f"{log_request(request_id)}inference input '{entry.name}' data-type is "
                f"'{entry.datatype}', but model '{config.name}' expects '{spec.datatype}'"
            )
        shape, dims = entry.shape, spec.dims
        if len(shape) != len(dims) + first:
            raise _shape_error(entry, dims, config, request_id)
        for index, want in enumerate(dims):
            if want != shape[index + first] and want != -1:
                raise _shape_error(entry, dims, config, request_id)
        entry.count = element_count(shape)
        if entry.count > limits.max_elements:
            raise InvalidInput(
                f"{entry.label}: shape {fmt_shape(entry.shape)} has {entry.count} elements, "
                f"more than the limit of {limits.max_elements}"
            )
    return 1 if batch is None else batch


def _shape_error(
    entry: _Pending, dims: Sequence[int], config: ModelConfig, request_id: str
) -> InvalidInput:
    """Triton's text for a shape (batch dim included) that does not fit the model's dims."""
    batched = config.max_batch_size > 0
    expected = (-1, *dims) if batched else tuple(dims)
    shape = entry.shape
    note = _BATCH_NOTE if batched else ""
    return InvalidInput(
        f"{log_request(request_id)}unexpected shape for input '{entry.name}' for model "
        f"'{config.name}'. "
        f"Expected {fmt_shape(expected)}, got {fmt_shape(shape)}. {note}"
    )


# --------------------------------------------------------------------- outputs


def _parse_outputs(
    value: Any,
    config: ModelConfig,
    binary_default: bool,
    limits: RequestLimits,
    regions: RegionLookup,
    request_id: str,
) -> tuple[list[RequestedOutput], dict[str, int] | None]:
    """The requested outputs, and the class count of each output asked to classify."""
    if value is None or (isinstance(value, list) and not value):
        return [RequestedOutput(spec.name, binary_default) for spec in config.outputs], None
    if not isinstance(value, list):
        raise InvalidInput(f"request 'outputs' must be a list, got {json_type(value)}")
    outputs: list[RequestedOutput] = []
    classes: dict[str, int] | None = None
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
        binary = binary_default
        shm: _ShmParameters | None = None
        count = 0
        parameters = item.get("parameters")
        if parameters is not None:
            if not isinstance(parameters, dict):
                raise InvalidInput(
                    f"{label}: 'parameters' must be an object, got {json_type(parameters)}"
                )
            shm = _parse_shm_parameters(label, parameters)
            if "classification" in parameters:
                count = _classification(label, spec, parameters["classification"], shm)
            flag = parameters.get("binary_data")
            if flag is not None:
                if not isinstance(flag, bool):
                    raise InvalidInput(
                        f"{label}: parameters.binary_data must be a boolean, got {json_type(flag)}"
                    )
                binary = flag
                if flag and shm is not None:
                    raise InvalidInput(
                        "Output can't set both 'shared_memory_region' and 'binary_data'; "
                        f"{label}: an output in shared memory (parameters.{_SHM_REGION}) "
                        "cannot also ask for parameters.binary_data"
                    )
        if shm is None:
            outputs.append(RequestedOutput(name, binary, None, "", count))
            if count:
                classes = classes or {}
                classes[name] = count
        else:
            ref = regions.resolve(label, shm.region, shm.offset, shm.byte_size, output=True)
            outputs.append(RequestedOutput(name, False, ref, shm.region))
    return outputs, classes


def _classification(label: str, spec: TensorSpec, value: Any, shm: _ShmParameters | None) -> int:
    """The requested class count (0: no classification), checked as Triton checks it."""
    if shm is not None:
        raise InvalidInput(
            f"Output can't set both 'shared_memory_region' and 'classification'; {label}"
        )
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _MAX_CLASSES:
        shown = value if isinstance(value, int) and not isinstance(value, bool) else None
        raise InvalidInput(
            f"Unable to set 'classification': {label}: parameters.classification must be an "
            f"unsigned 32-bit integer, got {shown if shown is not None else json_type(value)}"
        )
    if value and spec.datatype not in CLASSIFIABLE:
        raise InvalidInput(f"{unsupported_message(spec.datatype)}; {label}")
    return value


# ------------------------------------------------------------------------ data


def _read_input_data(
    pending: list[_Pending],
    binary: memoryview,
    no_header: bool,
    limits: RequestLimits,
    regions: RegionLookup,
    config: ModelConfig,
    request_id: str,
) -> list[InputTensor]:
    inputs: list[InputTensor] = []
    offset = 0
    available = len(binary)
    for entry in pending:
        if entry.shm is not None:
            inputs.append(_shm_input(entry, entry.shm, regions, config, request_id))
            continue
        if entry.binary_size is None:
            try:
                data = json_to_buffer(
                    entry.label,
                    entry.datatype,
                    entry.shape,
                    entry.count,
                    entry.data,
                    limits.max_json_depth,
                )
            except BytesCountMismatch as exc:
                raise InvalidInput(
                    _string_count_message(entry, exc.found, config, request_id)
                ) from None
        else:
            data = _slice_binary(entry, binary, offset, no_header, config, request_id)
            offset += entry.binary_size
        inputs.append(InputTensor(entry.name, entry.datatype, entry.shape, data))
    if offset != available:
        raise InvalidInput(
            f"unexpected additional input data for model '{config.name}'; the request body has "
            f"{available - offset} bytes after the JSON header that no input's "
            "parameters.binary_data_size accounts for"
        )
    return inputs


def _byte_size_message(
    entry: _Pending, expected: int, got: int, config: ModelConfig, request_id: str
) -> str:
    return (
        f"{log_request(request_id)}input byte size mismatch for input '{entry.name}' for model "
        f"'{config.name}'. Expected {expected}, got {got}"
    )


def _string_count_message(
    entry: _Pending, found: int, config: ModelConfig, request_id: str, detail: str = ""
) -> str:
    """Triton's texts (``ValidateBytesInputs``): too few elements, or too many (where
    Triton stops counting at one past the expected count; the real count follows)."""
    where = f"for inference input '{entry.name}' for model '{config.name}'"
    if found < entry.count:
        message = (
            f"{log_request(request_id)}expected {entry.count} string elements {where}, got {found}"
        )
    else:
        message = (
            f"{log_request(request_id)}unexpected number of string elements "
            f"{entry.count + 1} {where}, expecting {entry.count}"
        )
        detail = detail or f"the data holds {found}"
    return f"{message}; {detail}" if detail else message


def _slice_binary(
    entry: _Pending,
    binary: memoryview,
    offset: int,
    no_header: bool,
    config: ModelConfig,
    request_id: str,
) -> memoryview:
    size = entry.binary_size
    assert size is not None
    element_size = ELEMENT_SIZE.get(entry.datatype)
    if element_size is not None and size != entry.count * element_size:
        raise InvalidInput(
            _byte_size_message(entry, entry.count * element_size, size, config, request_id)
            + f"; parameters.binary_data_size is {size} but shape {fmt_shape(entry.shape)} "
            f"of {entry.datatype} needs {entry.count * element_size} bytes"
        )
    left = len(binary) - offset
    if size > left:
        hint = (
            " (binary data needs the Inference-Header-Content-Length header)" if no_header else ""
        )
        raise InvalidInput(
            f"unexpected size for input '{entry.name}', expecting {size - left} additional "
            f"bytes for model '{config.name}'; parameters.binary_data_size {size} exceeds the "
            f"{left} bytes of binary data left in the request body{hint}"
        )
    chunk = binary[offset : offset + size]
    if element_size is None:
        try:
            found = count_bytes_elements(chunk)
        except InvalidInput as exc:
            raise InvalidInput(f"{entry.label}: {exc.message}") from None
        if found != entry.count:
            raise InvalidInput(_string_count_message(entry, found, config, request_id))
    return chunk


def _shm_input(
    entry: _Pending,
    shm: _ShmParameters,
    regions: RegionLookup,
    config: ModelConfig,
    request_id: str,
) -> InputTensor:
    label = entry.label
    element_size = ELEMENT_SIZE.get(entry.datatype)
    if element_size is not None and shm.byte_size != entry.count * element_size:
        raise InvalidInput(
            _byte_size_message(entry, entry.count * element_size, shm.byte_size, config, request_id)
            + f"; parameters.{_SHM_SIZE} is {shm.byte_size} but shape "
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
            raise InvalidInput(_string_count_message(entry, found, config, request_id, detail))
    return InputTensor(entry.name, entry.datatype, entry.shape, b"", ref, shm.region)


# ------------------------------------------------------------------ raw binary


def _parse_raw(view: memoryview, config: ModelConfig, limits: RequestLimits) -> InferRequest:
    """Triton's raw binary request: the whole body is the single input's data.

    Triton's rules (core ``InferenceRequest::Normalize``): the model has one input; its
    shape is the model's dims (after a batch dim of 1 for batching models) with at most
    one -1, deduced from the body's size; a BYTES input must have dims of one element and
    no -1 (e.g. ``[1]``) and the body is that one element. All outputs are binary."""
    prefix = log_request("")
    if len(config.inputs) != 1:
        raise InvalidInput(
            f"{prefix}Raw request must only have 1 input (found 1) to be deduced but got "
            f"{len(config.inputs)} inputs in '{config.name}' model configuration"
        )
    spec = config.inputs[0]
    label = f"input '{spec.name}'"
    dims = tuple(spec.dims)
    leading = (1,) if config.max_batch_size > 0 else ()
    size = len(view)
    variable = [index for index, dim in enumerate(dims) if dim == -1]
    fixed_count = element_count([d for d in dims if d != -1])
    data: bytes | memoryview
    if spec.datatype == BYTES:
        if variable or fixed_count != 1:
            raise InvalidInput(
                f"{prefix}For BYTE datatype raw input '{spec.name}', the model must have input "
                f"shape [1]; its shape is {fmt_shape(dims)}"
            )
        if size > _MAX_BYTES_ELEMENT:
            raise InvalidInput(f"{label}: raw BYTES element is longer than 2^32-1 bytes")
        shape = (*leading, *dims)
        data = b"".join((_LENGTH.pack(size), view))
    else:
        if len(variable) > 1:
            raise InvalidInput(
                f"{prefix}The shape of the raw input '{spec.name}' can not be deduced because "
                "there are more than one variable-sized dimension"
            )
        element_size = ELEMENT_SIZE[spec.datatype]
        resolved = list(dims)
        if variable:  # floor division, as Triton; a remainder fails the byte size check
            item_bytes = fixed_count * element_size
            resolved[variable[0]] = size // item_bytes if item_bytes else 0
        shape = (*leading, *resolved)
        expected = element_count(shape) * element_size
        if size != expected:
            raise InvalidInput(
                f"{prefix}input byte size mismatch for input '{spec.name}' for model "
                f"'{config.name}'. Expected {expected}, got {size}; the raw body is not a "
                f"whole number of {spec.datatype} items of model shape {fmt_shape(dims)}"
            )
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
