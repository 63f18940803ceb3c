"""The data plane's inference path, whatever the transport: route, parse and check a
request against the model (:func:`prepare`, :func:`prepare_with`), queue it and await its
answer (:func:`execute`, :func:`execute_stream`). REST (:mod:`sluice.gateway.http.fast_path`), gRPC,
jobs, generate and TorchServe's routes all go through here. A label may come in the URL,
the ``Sluice-Version-Label`` header or the ``version_label`` request parameter (see
:mod:`sluice.core.routing`)."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import orjson

from sluice.core.clock import CLOCK
from sluice.core.config import DynamicBatching, ModelConfig
from sluice.core.datatypes import BYTES
from sluice.core.errors import (
    QUEUE_UNREACHABLE,
    InvalidInput,
    SluiceError,
    Unavailable,
    Unsupported,
    error_from_kind,
)
from sluice.core.keys import Keys
from sluice.core.observability.trace_context import TraceParent
from sluice.core.response_cache import CacheLookup, ResponseCache
from sluice.core.routing import PARAMETER, parameter_label
from sluice.core.sequences import batch_size_problem, check_corrid, sequence_of
from sluice.core.shm import unlink
from sluice.core.tenants import ANONYMOUS, CURRENT_TENANT
from sluice.core.wire import ReplyMessage, RequestMessage, TensorHeader
from sluice.gateway.control.catalog_follow import asked_fresh, follow_changes, redis_back
from sluice.gateway.control.demand_wake import wake_on_demand
from sluice.gateway.inference import request_id
from sluice.gateway.inference.header_forwarding import FORWARDED, add_forwarded
from sluice.gateway.inference.parsing import parse_infer_request
from sluice.gateway.inference.queue_turn import QueueTurn
from sluice.gateway.inference.request import InferRequest, RequestedOutput
from sluice.gateway.inference.response import encode_infer_response
from sluice.gateway.shm.leases import holding_regions, holding_regions_stream
from sluice.gateway.shm.references import SHM_REGION
from sluice.gateway.shm.registry import RegionMiss
from sluice.gateway.shm.transfer import TensorTransfer
from sluice.gateway.state import GatewayState
from sluice.gateway.tenants.streams import make_known

if TYPE_CHECKING:
    from sluice.core.observability.otel import RequestSpan

_NS_PER_US = 1_000
OFFLOAD_BYTES = 64 * 1024
"""Requests (and answers) with more bytes than this are parsed, packed and encoded on a
thread, so that no work proportional to a tensor's size runs on the event loop."""
PARSED_ON_LOOP_BYTES = 4 * 1024
"""The most bytes of a request parsed element by element (JSON, typed gRPC contents, BYTES
elements) that are parsed on the event loop; beyond, on a thread. Such bytes cost up to
~150 ns each to parse (a JSON list of empty strings, or gRPC ``bytes_contents``), so the
loop is held at most ~0.6 ms; below, a thread's hand-off (~35 µs of the loop's own time
and ~50 µs of the request's) would cost about what it saves. Tensors in binary form are
sliced, not read, and stay on the loop up to :data:`OFFLOAD_BYTES` (``bench.parse_cost``
measures both)."""
_SHM_MARK = SHM_REGION.encode()
_BYTES_MARK = BYTES.encode()
"""A BYTES input's elements are counted one by one while parsed (read from its region when
in shared memory): a header that names one may be heavy whatever its size."""
_ESCAPE = b"\\u"
"""JSON may write any letter of those names as an escape (``BYTE\\u0053``)."""

_GATEWAY_PARAMETERS = frozenset(("timeout", "priority", PARAMETER))
"""Request parameters the gateway consumes; the others travel on to the worker."""

T = TypeVar("T")


async def _off_loop(heavy: bool, work: Callable[[], T]) -> T:
    """``work()`` on a thread when ``heavy``, else here (a thread hop costs ~50 µs)."""
    return await asyncio.to_thread(work) if heavy else work()


def _timeout_us(request: InferRequest, state: GatewayState, model_default_us: int) -> int:
    timeout = request.parameters.get("timeout")
    default_us = model_default_us or int(state.settings.default_timeout_s * 1_000_000)
    if timeout is None:
        return default_us
    if not isinstance(timeout, int) or isinstance(timeout, bool) or timeout < 0:
        raise InvalidInput("parameter 'timeout' must be a non-negative integer (microseconds)")
    return min(timeout, default_us) if timeout else default_us


def _priority(request: InferRequest, dynamic: DynamicBatching | None) -> int:
    """The priority level whose stream takes the request (0: the model has no levels). As in
    Triton, a priority of 0 or past the model's levels takes its default level."""
    priority = request.parameters.get("priority", 0)
    if not isinstance(priority, int) or isinstance(priority, bool) or priority < 0:
        raise InvalidInput("parameter 'priority' must be a non-negative integer")
    levels = dynamic.priority_levels if dynamic else 0
    if not levels:
        return 0
    if priority == 0 or priority > levels:
        return (dynamic.default_priority_level if dynamic else 0) or levels
    return priority


@dataclass(slots=True)
class Prepared:
    """A request that passed validation: what either path (online or job) queues."""

    parsed: InferRequest
    model: str
    number: int
    """The model version it goes to."""
    level: int
    """Its priority level (0: the model has none)."""
    timeout_us: int
    max_queue: int
    request_id: str
    routed: bool
    """It named no version and no label: the model's split (and shadow) apply."""
    slot: int | None = None
    """A sequence model's request: the instance (slot) that holds its sequence."""
    decoupled: bool = False
    """The model answers any number of times (only streaming routes can carry that)."""
    tenant: str = ANONYMOUS
    """Whose request it is (from the caller's key)."""
    cached: bool = False
    """Its model enables Triton's response cache (``response_cache { enable: true }``)."""

    @property
    def named_tenant(self) -> str:
        """The tenant as streams and entries name it ("": the anonymous tenant)."""
        return "" if self.tenant == ANONYMOUS else self.tenant

    def stream(self, keys: Keys) -> str:
        if self.slot is not None:
            return keys.sequence_stream(self.model, self.number, self.slot)
        return keys.request_stream(self.model, self.number, self.level, self.named_tenant)


async def prepare(
    state: GatewayState,
    model: str,
    version: str | None,
    body: bytes,
    json_length: int | None,
    label: str | None = None,
    *,
    default_timeout_us: int = 0,
) -> Prepared:
    """Route, parse and check one inference request against the model's configuration.

    ``label``: the version label named by the URL or the header (see
    :func:`sluice.core.routing.requested_label`). ``default_timeout_us``: the deadline when the
    request sets none, instead of the model's queue policy or ``SLUICE_DEFAULT_TIMEOUT_S``
    (a job's time to live in the queue)."""
    return await prepare_with(
        state,
        model,
        version,
        lambda config: parse_infer_request(body, json_length, config, state.limits, state.regions),
        parsed_heavily(body, json_length),
        label,
        default_timeout_us=default_timeout_us,
    )


def parsed_heavily(body: bytes, json_length: int | None) -> bool:
    """Whether a REST request is parsed on a thread: a large one, one with more JSON than
    :data:`PARSED_ON_LOOP_BYTES`, one with as many bytes of binary data when its header
    names a BYTES input (whose elements are counted one by one), or one with a BYTES input
    in a shared memory region. Looked for in the bytes, without parsing them; a small
    header that lacks those names but has escapes is decoded here to look at its inputs."""
    size = len(body)
    if size > OFFLOAD_BYTES:
        return True
    if json_length is not None and not 0 < json_length <= size:
        return False  # raw binary (0: one tensor, a slice of the body), or refused at once
    header = body if json_length is None else body[:json_length]
    if len(header) > PARSED_ON_LOOP_BYTES:
        return True
    counted = size - len(header) > PARSED_ON_LOOP_BYTES  # (too many to count BYTES in here)
    if _BYTES_MARK in header and (counted or _SHM_MARK in header):
        return True
    if _ESCAPE not in header:
        return False
    try:
        document = orjson.loads(header)
    except orjson.JSONDecodeError:
        return False  # (the parser says why)
    inputs = document.get("inputs") if isinstance(document, dict) else None
    return isinstance(inputs, list) and any(_heavy_bytes_input(item, counted) for item in inputs)


def _heavy_bytes_input(item: object, counted: bool) -> bool:
    """A BYTES input whose elements are too many (``counted``) or in a shared memory region."""
    if not isinstance(item, dict) or item.get("datatype") != BYTES:
        return False
    parameters = item.get("parameters")
    return counted or (isinstance(parameters, dict) and SHM_REGION in parameters)


async def prepare_with(
    state: GatewayState,
    model: str,
    version: str | None,
    parse: Callable[[ModelConfig], InferRequest],
    heavy: bool,
    label: str | None = None,
    *,
    default_timeout_us: int = 0,
    deadline_us: int = 0,
) -> Prepared:
    """:func:`prepare` for any wire form: ``parse`` checks the request against the model's
    configuration (on a thread when ``heavy``). ``deadline_us``: the most time the client
    itself waits (a gRPC deadline), which caps the request's timeout."""
    if not state.redis_ok and not await redis_back(state):
        raise Unavailable(QUEUE_UNREACHABLE)
    if state.host_changes.value() != state.host_seen:
        await follow_changes(state)  # a load or unload through another gateway process
    entry, number = await asked_fresh(state, lambda: state.view.route(model, version, label))
    config = entry.config
    assert config is not None
    try:
        parsed = await _off_loop(heavy, lambda: parse(config))
    except RegionMiss as miss:  # a region changed through another gateway process?
        if not await state.regions.recover(miss):
            raise
        parsed = await _off_loop(heavy, lambda: parse(config))
    forwarded = FORWARDED.get()
    if forwarded:  # (Triton's --http- and --grpc-header-forward-pattern)
        add_forwarded(parsed.parameters, forwarded)
    named = parsed.parameters.get(PARAMETER)
    if named is not None:
        late_label = parameter_label(named, version, label)
        if late_label is not None:  # (the model's configuration is the same for each version)
            entry, number = state.view.resolve(model, None, late_label)
    slot = _sequence_slot(parsed, config) if config.sequence_batching is not None else None
    dynamic = config.dynamic_batching
    model_default_us = dynamic.default_timeout_us if dynamic else 0
    timeout_us = _timeout_us(parsed, state, default_timeout_us or model_default_us)
    if deadline_us:
        timeout_us = max(1, min(timeout_us, deadline_us))
    return Prepared(
        parsed,
        model,
        number,
        _priority(parsed, dynamic),
        timeout_us,
        max_queue_of(config, state.settings.default_max_queue_size),
        request_id.settle(parsed.id),
        version is None and label is None and named is None and slot is None,
        slot,
        config.decoupled,
        CURRENT_TENANT.get(),
        config.response_cache,
    )


def max_queue_of(config: ModelConfig, default: int) -> int:
    """A model's queue limit: its ``max_queue_size``, else the deployment's default."""
    dynamic = config.dynamic_batching
    return (dynamic.max_queue_size if dynamic else 0) or default


def refuse_early(state: GatewayState, model: str, version: str | None, label: str | None) -> None:
    """Refuse, before its body is read, a request that admission would refuse anyway: the
    caller's tenant is over its rate or its requests in flight, or the model's queue (as
    far as this process knows) has no room for it. A flood of large requests then costs
    the refusals, not the reading and parsing of bodies that go nowhere. Silent when the
    model or version is unknown here: the full path says why."""
    try:
        entry, number = state.view.resolve(model, version, label)
    except SluiceError:
        return
    if entry.config is None:
        return
    tenant = CURRENT_TENANT.get()
    state.quota.check_early(tenant)
    max_queue = max_queue_of(entry.config, state.settings.default_max_queue_size)
    state.admission.check_room(model, number, max_queue, "", tenant)


def _sequence_slot(parsed: InferRequest, config: ModelConfig) -> int:
    """The slot of a sequence model's request (Triton's errors for what it lacks)."""
    ref = sequence_of(parsed.parameters, config.name)
    if config.max_batch_size > 0 and parsed.batch_size != 1:
        raise batch_size_problem(config.name)
    assert config.sequence_batching is not None
    check_corrid(ref, config.sequence_batching, config.name)
    return ref.slot(config.total_instances)


def request_message(
    state: GatewayState,
    request: Prepared,
    headers: list[TensorHeader],
    trace: TraceParent | None,
    *,
    local: bool,
    inline: bool = False,
) -> RequestMessage:
    """The stream entry's header for a prepared request; ``local``: its workers share this
    host (:meth:`TensorTransfer.local`); ``inline``: every output comes back in the answer
    itself (no shared memory), as a job's must."""
    parsed, transfer = request.parsed, state.transfer
    inline = inline or not local
    now_ns = CLOCK.now_ns()
    return RequestMessage(
        request_key="",
        reply_to="",
        inputs=headers,
        outputs=[o.name for o in parsed.outputs],
        client_id=parsed.id,
        deadline_ns=now_ns + request.timeout_us * _NS_PER_US,
        enqueued_ns=now_ns,
        priority=request.level,
        parameters={k: v for k, v in parsed.parameters.items() if k not in _GATEWAY_PARAMETERS},
        output_regions={} if inline else transfer.output_regions(parsed.outputs, local),
        segment_prefix="" if inline else transfer.message_prefix,
        segment_min_bytes=0 if inline else transfer.segment_min_bytes,
        classes=parsed.classes or {},
        host="" if inline else transfer.host,
        request_id=request.request_id,
        trace=trace,
        tenant=request.named_tenant,
    )


async def run_infer(
    state: GatewayState,
    model: str,
    version: str | None,
    body: bytes,
    json_length: int | None,
    trace: TraceParent | None = None,
    span: RequestSpan | None = None,
    label: str | None = None,
) -> tuple[bytes, int | None]:
    """Validate, queue, await and encode one request: (response body, JSON header length).

    ``trace`` goes into the stream entry for the worker; ``span`` (when tracing) gets a
    ``reply`` child while the answer is turned into the response."""
    request = await prepare(state, model, version, body, json_length, label)
    parsed, transfer = request.parsed, state.transfer
    return await execute(
        state,
        request,
        len(body) > OFFLOAD_BYTES,
        lambda reply, data: encode_reply(transfer, model, reply, data, parsed.outputs, parsed.id),
        trace,
        span,
    )


@holding_regions  # (its client regions stay registered until it ends)
async def execute(
    state: GatewayState,
    request: Prepared,
    big: bool,
    encode: Callable[[ReplyMessage, memoryview], T],
    trace: TraceParent | None = None,
    span: RequestSpan | None = None,
    *,
    endpoint: str = "HTTP end point",
    turn: QueueTurn | None = None,
) -> T:
    """Queue a prepared request, await its answer and ``encode`` it (on a thread when the
    answer is large), whatever the wire form: REST and gRPC share this path. ``big``: the
    request's bytes are many (packed on a thread). ``endpoint`` names the route in
    Triton's refusal of decoupled models (which answer on streaming routes only); ``turn``:
    the request's place among its gRPC stream's (see :mod:`sluice.gateway.inference.queue_turn`)."""
    if request.decoupled:
        raise Unsupported(f"{endpoint} doesn't support models with decoupled transaction policy")
    parsed, model, number, level = request.parsed, request.model, request.number, request.level
    transfer = state.transfer
    in_regions = any(tensor.shm is not None for tensor in parsed.inputs)
    stream = request.stream(state.keys)
    local = transfer.local(state.view, model, number)
    state.redis_room.check()
    await make_known(state, model, number, stream)
    await wake_on_demand(state, model, number)
    tenant = request.tenant
    cache = _cache_for(state, request, in_regions)
    with (
        state.quota.hold(tenant, parsed.inputs),
        state.admission.admit(model, number, request.max_queue, parsed.id, tenant),
    ):
        # Across hosts, inputs in client regions are read into the entry by the gateway.
        heavy_pack = big or (in_regions and not local)
        headers, payload, segment = await _off_loop(
            heavy_pack, lambda: transfer.pack(parsed.inputs, local=local, inline=cache is not None)
        )
        lookup: CacheLookup | None = None
        try:
            message = request_message(
                state, request, headers, trace, local=local, inline=cache is not None
            )
            if cache is not None:
                lookup = await CacheLookup.start(
                    cache,
                    request.named_tenant,
                    model,
                    number,
                    (state.view.revision or b"").decode(),
                    message,
                    payload,
                    big,
                    OFFLOAD_BYTES,
                )
            if lookup is not None and lookup.hit is not None:
                if turn is not None:
                    turn.done.set()  # (never queued: its stream's next request may go)
                reply, data = lookup.hit
                await lookup.counted(state.keys.stats(model, number))
            else:
                if request.routed:
                    _shadow(state, model, number, level, message, payload, segment)
                submit = state.dispatcher.submit(
                    model, stream, message, payload, request.timeout_us / 1_000_000
                )
                reply, data = await (turn.queue(submit) if turn is not None else submit)
                if lookup is not None and not reply.error_kind:
                    await lookup.keep(reply, data, OFFLOAD_BYTES, state.keys.stats(model, number))
        finally:
            if segment is not None:
                unlink(segment)
        reply_span = span.reply() if span is not None else None
        try:
            if reply.error_kind:
                raise error_from_kind(reply.error_kind, reply.error)
            answer_bytes = transfer.bytes_to_handle(reply.outputs)
            return await _off_loop(answer_bytes > OFFLOAD_BYTES, lambda: encode(reply, data))
        finally:
            transfer.discard(reply.outputs)
            if reply_span is not None:
                reply_span.end(reply.error_kind)


@holding_regions_stream
async def execute_stream(
    state: GatewayState,
    request: Prepared,
    big: bool,
    encode: Callable[[ReplyMessage, memoryview], T],
    trace: TraceParent | None = None,
) -> AsyncGenerator[tuple[ReplyMessage, T | None], None]:
    """:func:`execute` for streaming routes: each response as it comes, encoded (None for
    a final response that carries no outputs), until the final one. A model that is not
    decoupled gives one."""
    transfer = state.transfer
    state.redis_room.check()
    await make_known(state, request.model, request.number, request.stream(state.keys))
    await wake_on_demand(state, request.model, request.number)
    with (
        state.quota.hold(request.tenant, request.parsed.inputs),
        state.admission.admit(
            request.model, request.number, request.max_queue, request.parsed.id, request.tenant
        ),
    ):
        local = transfer.local(state.view, request.model, request.number)
        headers, payload, segment = await _off_loop(
            big or (not local and any(t.shm is not None for t in request.parsed.inputs)),
            lambda: transfer.pack(request.parsed.inputs, local=local, inline=True),
        )
        try:
            message = request_message(state, request, headers, trace, local=local, inline=True)
            replies = state.dispatcher.submit_stream(
                request.model,
                request.stream(state.keys),
                message,
                payload,
                request.timeout_us / 1_000_000,
            )
            async for reply, data in replies:
                if reply.error_kind:
                    raise error_from_kind(reply.error_kind, reply.error)
                if not reply.outputs:
                    yield reply, None
                    continue
                heavy = transfer.bytes_to_handle(reply.outputs) > OFFLOAD_BYTES
                yield reply, await _off_loop(heavy, functools.partial(encode, reply, data))
        finally:
            if segment is not None:
                unlink(segment)


def _cache_for(state: GatewayState, request: Prepared, in_regions: bool) -> ResponseCache | None:
    """The response cache, when it may answer ``request``: its model enables it, the
    deployment has one, and the request is one answer of a model without sequences whose
    inputs and outputs travel in the request and the answer (not in client regions)."""
    cache = state.cache
    if cache is None or not request.cached or request.slot is not None or in_regions:
        return None
    if any(output.shm is not None for output in request.parsed.outputs):
        return None
    return cache


def _shadow(
    state: GatewayState,
    model: str,
    chosen: int,
    level: int,
    message: RequestMessage,
    payload: bytes,
    segment: str | None,
) -> None:
    """Mirror the request to the model's shadow version, when it has one and the draw says
    so (a rollout's shadow phase). Requests whose tensors live in shared memory are not
    mirrored: the copy must not outlive what it references."""
    shadow = state.view.mirror(model, chosen)
    if shadow is None or segment is not None or message.output_regions:
        return
    if any(header.shm is not None for header in message.inputs):
        return
    state.dispatcher.mirror(state.keys.request_stream(model, shadow, level), message, payload)


def encode_reply(
    transfer: TensorTransfer,
    model: str,
    reply: ReplyMessage,
    data: memoryview,
    requested: list[RequestedOutput],
    request_id: str,
) -> tuple[bytes, int | None]:
    """The response to a worker's answer: the outputs in the form the client asked for."""
    outputs = transfer.unpack(reply.outputs, data, requested)
    by_name = {o.name: o for o in requested}
    asked = [by_name.get(o.name) for o in outputs]
    return encode_infer_response(
        model_name=model,
        model_version=str(reply.model_version),
        request_id=request_id,
        outputs=outputs,
        binary=[a is not None and a.binary for a in asked],
        json_asked=[a is not None and a.json_asked for a in asked],
        parameters=reply.parameters,
    )
