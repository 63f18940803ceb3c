"""Typed messages between gateway and workers, as Redis stream entries.

An entry has two fields: ``h``, a msgpack header carrying a schema version,
and ``d``, the tensor bytes of the message concatenated in header order
(Triton's binary layout). A tensor whose header carries a shared memory reference
(:class:`ShmRef`) has no bytes in ``d``: they are in a client's registered region or in
a segment of :mod:`sluice.core.shm` on this host. No pickle anywhere: a header is decoded
against the declared shape and anything else is rejected as :class:`MalformedEntry`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack

from sluice.core.datatypes import DATATYPES
from sluice.core.observability.trace_context import TraceParent, parse_traceparent
from sluice.core.shm import ShmKeyError, is_segment_prefix, object_name
from sluice.core.tenants import is_tenant_name

SCHEMA_VERSION = 2
_READABLE_VERSIONS = (1, 2)  # version 1 is version 2 without shared memory references
HEADER_FIELD = b"h"
DATA_FIELD = b"d"


class MalformedEntry(ValueError):
    """A stream entry that does not follow this schema."""


@dataclass(frozen=True, slots=True)
class ShmRef:
    """Bytes in a POSIX shared memory object: ``byte_size`` bytes at ``offset`` of ``key``."""

    key: str
    offset: int
    byte_size: int


@dataclass(slots=True)
class TensorHeader:
    name: str
    datatype: str
    shape: tuple[int, ...]
    nbytes: int
    """The tensor's size in the binary layout."""
    shm: ShmRef | None = None
    """Where the bytes are when not in the entry. On a reply output written into a client
    region, ``shm`` is that region and ``nbytes > shm.byte_size`` means it did not fit and
    nothing was written."""


@dataclass(slots=True)
class RequestMessage:
    request_key: str
    """Correlation id, unique within the gateway that sent it."""
    reply_to: str
    """Reply stream of that gateway."""
    inputs: list[TensorHeader]
    outputs: list[str]
    """Names of the outputs to compute and return, in response order."""
    client_id: str = ""
    deadline_ns: int = 0
    """Unix time in ns after which the request must not be computed; 0 = none."""
    enqueued_ns: int = 0
    priority: int = 0
    parameters: dict[str, Any] = field(default_factory=dict)
    output_regions: dict[str, ShmRef] = field(default_factory=dict)
    """Outputs the worker writes straight into a client's region instead of the reply."""
    segment_prefix: str = ""
    """Name prefix (``sluice-<namespace>-``) of this deployment's shared memory segments."""
    segment_min_bytes: int = 0
    """Outputs of at least this many bytes go through a segment the worker creates (the
    gateway reads and removes it); 0: every other output goes inline in the reply."""
    classes: dict[str, int] = field(default_factory=dict)
    """Outputs answered as their top-N classes (Triton's classification extension)."""
    host: str = ""
    """The gateway's host (:mod:`sluice.core.hosts`) when the request uses shared memory: only a
    worker on that host can serve it."""
    request_id: str = ""
    """The id logs and traces know the request by: the client's KServe ``id``, else its
    ``X-Request-ID``, else one the gateway made up (empty in entries of older gateways)."""
    trace: TraceParent | None = None
    """The W3C trace context the worker's spans and log lines belong to (the gateway's
    span, or the client's ``traceparent`` when the gateway does not trace)."""
    tenant: str = ""
    """Whose request it is (:mod:`sluice.core.tenants`); empty: the anonymous tenant, or a
    request from inside the deployment (an ensemble's step, a BLS call)."""
    replies_together: bool = False
    """Its reader takes several answers in one reply entry (:func:`encode_replies`): a
    worker may send the answers of one batch to one reader together. Entries of older
    readers lack it, and get one entry per answer."""


@dataclass(slots=True)
class ReplyMessage:
    request_key: str
    model_version: int
    outputs: list[TensorHeader] = field(default_factory=list)
    error_kind: str = ""
    """Empty on success, else the name of a :mod:`sluice.core.errors` class."""
    error: str = ""
    final: bool = True
    """False on the responses of a decoupled model before its last one for the request."""
    index: int | None = None
    """A decoupled model's non-final response: its place among the request's responses (0
    first). A request delivered again after its worker died is computed again from the
    start, and the gateway forwards only the responses past those it forwarded already."""
    parameters: dict[str, bool | int | str] = field(default_factory=dict)
    """The response's own parameters (an ensemble's ``sequence_id``, ``sequence_start``,
    ``sequence_end``), which the gateway puts on the HTTP and gRPC response."""


def _ref_out(ref: ShmRef) -> list[Any]:
    return [ref.key, ref.offset, ref.byte_size]


def _ref_in(raw: Any, what: str) -> ShmRef:
    if not (isinstance(raw, list) and len(raw) == 3):
        raise MalformedEntry(f"{what}: shared memory reference is not [key, offset, byte_size]")
    key, offset, byte_size = raw
    try:
        object_name(_str(key))
    except (ShmKeyError, TypeError):
        raise MalformedEntry(f"{what}: bad shared memory key {key!r}") from None
    if not (_natural(offset) and _natural(byte_size)):
        raise MalformedEntry(f"{what}: bad shared memory offset or size {offset!r} {byte_size!r}")
    return ShmRef(key, offset, byte_size)


def _tensors_out(tensors: Sequence[TensorHeader]) -> list[list[Any]]:
    return [
        [t.name, t.datatype, list(t.shape), t.nbytes]
        if t.shm is None
        else [t.name, t.datatype, list(t.shape), t.nbytes, _ref_out(t.shm)]
        for t in tensors
    ]


def _tensors_in(raw: Any, payload_size: int) -> list[TensorHeader]:
    if not isinstance(raw, list):
        raise MalformedEntry("tensor list is not a list")
    tensors: list[TensorHeader] = []
    total = 0
    for item in raw:
        if not isinstance(item, list):
            raise MalformedEntry("tensor header is not a list")
        if len(item) == 4:
            name, datatype, shape, nbytes = item
            ref = None
        elif len(item) == 5:
            name, datatype, shape, nbytes, raw_ref = item
            ref = _ref_in(raw_ref, f"tensor {name!r}")
        else:
            raise MalformedEntry("tensor header is not [name, datatype, shape, nbytes(, shm)]")
        if not isinstance(name, str) or datatype not in DATATYPES:
            raise MalformedEntry(f"bad tensor name or datatype: {name!r} {datatype!r}")
        if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
            raise MalformedEntry(f"tensor {name!r}: bad shape {shape!r}")
        if not isinstance(nbytes, int) or nbytes < 0:
            raise MalformedEntry(f"tensor {name!r}: bad byte size {nbytes!r}")
        if ref is None:
            total += nbytes
        tensors.append(TensorHeader(name, datatype, tuple(shape), nbytes, ref))
    if total != payload_size:
        raise MalformedEntry(f"tensor sizes add up to {total} bytes, payload has {payload_size}")
    return tensors


def _unpack(fields: Mapping[bytes, bytes]) -> tuple[dict[str, Any], memoryview]:
    try:
        header = msgpack.unpackb(fields[HEADER_FIELD], raw=False, strict_map_key=True)
        payload = memoryview(fields.get(DATA_FIELD, b""))
    except KeyError:
        raise MalformedEntry("entry has no header field") from None
    except (ValueError, msgpack.UnpackException) as exc:
        raise MalformedEntry(f"header is not msgpack: {exc}") from None
    if not isinstance(header, dict) or header.get("v") not in _READABLE_VERSIONS:
        raise MalformedEntry("header has no supported schema version")
    return header, payload


def encode_request(message: RequestMessage, payload: bytes) -> dict[bytes, bytes]:
    header = {
        "v": SCHEMA_VERSION,
        "k": message.request_key,
        "r": message.reply_to,
        "i": _tensors_out(message.inputs),
        "o": message.outputs,
        "c": message.client_id,
        "dl": message.deadline_ns,
        "t": message.enqueued_ns,
        "p": message.priority,
        "pa": message.parameters,
    }
    if message.output_regions:
        header["or"] = {name: _ref_out(ref) for name, ref in message.output_regions.items()}
    if message.segment_prefix:
        header["sp"] = message.segment_prefix
        header["sm"] = message.segment_min_bytes
    if message.classes:
        header["cl"] = message.classes
    if message.host:
        header["h"] = message.host
    if message.request_id:
        header["ri"] = message.request_id
    if message.tenant:
        header["tn"] = message.tenant
    if message.replies_together:
        header["rt"] = True
    if message.trace is not None:
        header["tp"] = message.trace.header
        if message.trace.state:
            header["ts"] = message.trace.state
    return {HEADER_FIELD: msgpack.packb(header), DATA_FIELD: payload}


def decode_request(fields: Mapping[bytes, bytes]) -> tuple[RequestMessage, memoryview]:
    header, payload = _unpack(fields)
    try:
        message = RequestMessage(
            request_key=_str(header["k"]),
            reply_to=_str(header["r"]),
            inputs=_tensors_in(header["i"], len(payload)),
            outputs=[_str(name) for name in header["o"]],
            client_id=_str(header.get("c", "")),
            deadline_ns=_int(header.get("dl", 0)),
            enqueued_ns=_int(header.get("t", 0)),
            priority=_int(header.get("p", 0)),
            parameters=dict(header.get("pa") or {}),
        )
        if "or" in header:
            message.output_regions = _output_regions(header["or"])
        if "sp" in header:
            message.segment_prefix = _str(header["sp"])
            message.segment_min_bytes = _int(header["sm"])
        if "cl" in header:
            message.classes = _classes(header["cl"])
        message.host = _str(header.get("h", ""))
        message.request_id = _str(header.get("ri", ""))
        message.tenant = _str(header.get("tn", ""))
        message.replies_together = header.get("rt") is True
        if "tp" in header:  # a malformed one is no trace context, as from a client
            message.trace = parse_traceparent(_str(header["tp"]), _str(header.get("ts", "")))
    except (KeyError, TypeError) as exc:
        raise MalformedEntry(f"request header is missing or has a bad field: {exc}") from None
    for tensor in message.inputs:
        if tensor.shm is not None and tensor.shm.byte_size != tensor.nbytes:
            raise MalformedEntry(f"input {tensor.name!r}: shared memory size is not its size")
    if message.segment_prefix and not is_segment_prefix(message.segment_prefix):
        raise MalformedEntry(f"bad segment prefix {message.segment_prefix!r}")
    if message.segment_min_bytes < 0:
        raise MalformedEntry("bad segment size threshold")
    if message.tenant and not is_tenant_name(message.tenant):
        raise MalformedEntry(f"bad tenant name {message.tenant[:80]!r}")
    return message, payload


def _classes(raw: Any) -> dict[str, int]:
    if not isinstance(raw, dict):
        raise TypeError("classification counts are not a map")
    classes = {_str(name): _int(count) for name, count in raw.items()}
    if any(count < 1 for count in classes.values()):
        raise TypeError("a classification count is below 1")
    return classes


def _output_regions(raw: Any) -> dict[str, ShmRef]:
    if not isinstance(raw, dict):
        raise TypeError("output regions are not a map")
    return {_str(name): _ref_in(ref, f"output {name!r}") for name, ref in raw.items()}


def encode_reply(message: ReplyMessage, payload: bytes = b"") -> dict[bytes, bytes]:
    header = {
        "v": SCHEMA_VERSION,
        "k": message.request_key,
        "m": message.model_version,
        "o": _tensors_out(message.outputs),
        "ek": message.error_kind,
        "e": message.error,
    }
    if not message.final:
        header["f"] = False
    if message.index is not None:
        header["i"] = message.index
    if message.parameters:
        header["p"] = message.parameters
    return {HEADER_FIELD: msgpack.packb(header), DATA_FIELD: payload}


def encode_replies(replies: Sequence[tuple[ReplyMessage, bytes]]) -> dict[bytes, bytes]:
    """Several answers in one reply entry, for a reader that takes them together: the
    first as :func:`encode_reply` writes it, the next ones under ``h1``/``d1``, ``h2``/``d2``
    and so on (one Redis command and one stream entry for a batch's answers to a reader,
    instead of one each)."""
    fields: dict[bytes, bytes] = {}
    for index, (message, payload) in enumerate(replies):
        one = encode_reply(message, payload)
        suffix = str(index).encode() if index else b""
        fields[HEADER_FIELD + suffix] = one[HEADER_FIELD]
        fields[DATA_FIELD + suffix] = one[DATA_FIELD]
    return fields


def decode_replies(fields: Mapping[bytes, bytes]) -> list[tuple[ReplyMessage, memoryview]]:
    """Every answer of a reply entry (one, or several: :func:`encode_replies`)."""
    replies = [decode_reply(fields)]
    index = 1
    while (header := fields.get(HEADER_FIELD + str(index).encode())) is not None:
        data = fields.get(DATA_FIELD + str(index).encode())
        if data is None:
            raise MalformedEntry(f"reply entry lacks the data of its answer {index}")
        replies.append(decode_reply({HEADER_FIELD: header, DATA_FIELD: data}))
        index += 1
    return replies


def decode_reply(fields: Mapping[bytes, bytes]) -> tuple[ReplyMessage, memoryview]:
    header, payload = _unpack(fields)
    try:
        message = ReplyMessage(
            request_key=_str(header["k"]),
            model_version=_int(header["m"]),
            outputs=_tensors_in(header["o"], len(payload)),
            error_kind=_str(header.get("ek", "")),
            error=_str(header.get("e", "")),
            final=header.get("f", True) is not False,
            index=_response_index(header.get("i")),
            parameters=_reply_parameters(header.get("p", {})),
        )
    except (KeyError, TypeError) as exc:
        raise MalformedEntry(f"reply header is missing or has a bad field: {exc}") from None
    return message, payload


def _response_index(raw: Any) -> int | None:
    if raw is None:
        return None
    if not _natural(raw):
        raise TypeError(f"bad response index {raw!r}")
    return int(raw)


def _reply_parameters(raw: Any) -> dict[str, bool | int | str]:
    if not isinstance(raw, dict):
        raise TypeError("reply parameters are not a map")
    for name, value in raw.items():
        if not isinstance(name, str) or not isinstance(value, bool | int | str):
            raise TypeError(f"reply parameter {name!r} is not a boolean, integer or string")
    return raw


def _str(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"expected a string, got {type(value).__name__}")
    return value


def _natural(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _int(value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"expected an integer, got {type(value).__name__}")
    return value
