"""``ModelInfer`` and ``ModelStreamInfer``: gRPC requests on the REST path's data plane.

Both take the request message as bytes and decode it here, on a thread when it is large or
holds many elements (:mod:`.offload`), and answer bytes encoded the same way, so that no
work proportional to a tensor's size runs on the event loop (gRPC's own deserializer would
run there). From the decoded message on, a request takes
:func:`sluice.gateway.inference.data_plane.prepare_with` and
:func:`sluice.gateway.inference.data_plane.execute`, as a REST one does: the same
validation, admission control, deadlines, priorities, version labels, shared memory and
shadow traffic. A gRPC deadline caps the request's timeout.

On a stream, requests are handled concurrently, each answered when its answer arrives
(matched by its ``id``, as Triton's clients do), and at most
``SLUICE_GRPC_STREAM_MAX_IN_FLIGHT`` at once: beyond, the stream reads no further, so that
HTTP/2 flow control holds the client back. As many answers at most wait for the client to
take them: a request whose answer finds no room keeps its place until there is, so a
client that sends and never reads is not read further (and a decoupled model's responses
stay in the dispatcher's bounded backlog). A failed request answers a stream response with
``error_message`` and the request's ``id``; the stream goes on. A stream the client
cancels takes its requests under way with it: their places in the dispatcher and in
admission control are given back at once.

Memory: each message's bytes are charged to the body budget HTTP bodies share
(``SLUICE_MAX_BUFFERED_BODY_BYTES``) as soon as the message has arrived, before it is
decoded, and given back once it is answered; a message that does not fit is refused
(UNAVAILABLE, or a stream response with its ``id``). What may be arriving at once is
bounded apart (:mod:`sluice.gateway.grpc_api.limits`): ModelInfer messages are read in turn
(:mod:`sluice.gateway.grpc_api.receiving`), streams are limited in number and ended when idle
(:mod:`sluice.gateway.grpc_api.stream_idle`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

import grpc
from google.protobuf.message import DecodeError

from sluice.core.config import ModelConfig
from sluice.core.errors import InvalidInput, QuotaExceeded, ServerBusy, SluiceError
from sluice.core.observability.logs import TRACE_ID
from sluice.core.observability.trace_context import TraceParent, parse_traceparent
from sluice.core.request_parameters import forward_pattern
from sluice.core.routing import HEADER
from sluice.core.tenants import ANONYMOUS, CURRENT_TENANT
from sluice.core.wire import ReplyMessage
from sluice.gateway.body_budget import BodyReservation
from sluice.gateway.grpc_api.wire_fields import varint
from sluice.gateway.inference import request_id
from sluice.gateway.inference.data_plane import (
    OFFLOAD_BYTES,
    Prepared,
    execute,
    execute_stream,
    prepare_with,
)
from sluice.gateway.inference.header_forwarding import FORWARDED, matching
from sluice.gateway.inference.parsing import parse_infer_document
from sluice.gateway.inference.queue_turn import QueueTurn
from sluice.gateway.inference.request import InferRequest, RequestLimits
from sluice.gateway.shm.transfer import TensorTransfer
from sluice.gateway.state import GatewayState

from .entry_counts import check_entry_counts
from .limits import GrpcLimits
from .offload import decoded_on_thread
from .protocol import service_pb2
from .receiving import Receiving
from .status import describe, status_of
from .stream_idle import StreamActivity, next_message
from .tensors import encode_response, request_document
from .wire_id import request_id_of

if TYPE_CHECKING:
    from sluice.core.observability.otel import RequestSpan

log = logging.getLogger(__name__)

_SHM = "shared_memory_region"
_LABEL_METADATA = HEADER.lower()
_EMPTY_FINAL = "triton_enable_empty_final_response"
_FINAL = "triton_final_response"


def metadata_of(context: grpc.aio.ServicerContext[Any, Any]) -> dict[str, str]:
    """The call's metadata (text values; the first of a repeated key)."""
    found: dict[str, str] = {}
    for key, value in context.invocation_metadata() or ():
        if isinstance(value, str):
            found.setdefault(key, value)
    return found


Denial = Callable[[dict[str, str]], "tuple[grpc.StatusCode, str] | None"]
"""Why a call with this metadata may not infer (its key), or None."""

Sink = Callable[[bytes], Awaitable[None]]
"""Takes one stream response for the client; returns once there is room for it."""


class InferCalls:
    def __init__(
        self, state: GatewayState, limits: GrpcLimits, denied: Denial = lambda _: None
    ) -> None:
        self.state = state
        self.limits = limits
        self.denied = denied
        self.receiving = Receiving(limits)
        self.open_streams = 0
        self.tenant_streams: dict[str, int] = {}
        """Streams open per named tenant (none at 0)."""
        self.forward = forward_pattern(state.settings.grpc_header_forward_pattern)
        """Metadata that becomes request parameters
        (:mod:`sluice.gateway.inference.header_forwarding`)."""

    async def model_infer(
        self, messages: AsyncIterator[bytes], context: grpc.aio.ServicerContext[bytes, bytes]
    ) -> bytes:
        """One ModelInfer call (served as client-streaming: see :mod:`.receiving`)."""
        metadata = metadata_of(context)
        denied = self.denied(metadata)
        if denied is not None:  # (before the message is read)
            context.set_code(denied[0])
            context.set_details(denied[1])
            return b""
        remaining = context.time_remaining()
        reservation = self.state.bodies.reservation()
        try:
            request, size, on_thread = await self._received(context, reservation)
            return await self.infer(request, size, metadata, remaining, on_thread=on_thread)
        except Exception as exc:
            _fail(context, exc)
            return b""  # (not sent: the call ends with the error's status)
        finally:
            reservation.release()

    async def _received(
        self, context: grpc.aio.ServicerContext[bytes, bytes], reservation: BodyReservation
    ) -> tuple[Any, int, bool]:
        """The call's request, decoded, its size, charged to ``reservation``, and whether it
        is parsed on a thread."""
        message = await self.receiving.one(context)
        reservation.ensure(len(message))
        on_thread = decoded_on_thread(message)
        return await self.decode(message, on_thread), len(message), on_thread

    async def model_stream_infer(
        self, messages: AsyncIterator[bytes], context: grpc.aio.ServicerContext[bytes, bytes]
    ) -> AsyncIterator[bytes]:
        limit = self.limits.open_streams
        tenant = CURRENT_TENANT.get()  # (set by the key's check)
        named = tenant != ANONYMOUS
        held = self.tenant_streams.get(tenant, 0)
        if named and held >= self.limits.tenant_open_streams:
            over = QuotaExceeded(
                f"tenant '{tenant}' has {held} ModelStreamInfer streams open on this gateway "
                "process, its share (SLUICE_GRPC_TENANT_MAX_OPEN_STREAMS="
                f"{self.limits.tenant_open_streams}); close one or retry later",
                1,
            )
            _fail(context, over)
            return
        if self.open_streams >= limit:
            busy = ServerBusy(
                f"the gateway has {self.open_streams} ModelStreamInfer streams open, its limit "
                "(SLUICE_GRPC_MAX_OPEN_STREAMS); retry later",
                1,
            )
            _fail(context, busy)
            return
        self.open_streams += 1
        if named:
            self.tenant_streams[tenant] = held + 1
        try:
            async for answer in self._stream(context):
                yield answer
        finally:
            self.open_streams -= 1
            if named:
                left = self.tenant_streams.get(tenant, 1) - 1
                if left > 0:
                    self.tenant_streams[tenant] = left
                else:
                    self.tenant_streams.pop(tenant, None)

    async def _stream(
        self, context: grpc.aio.ServicerContext[bytes, bytes]
    ) -> AsyncIterator[bytes]:
        """The stream's answers; its requests are read with ``context.read()`` (see
        :mod:`.receiving`), not from the iterator grpcio hands the handler."""
        metadata = metadata_of(context)
        answers: asyncio.Queue[bytes | None] = asyncio.Queue()
        in_flight = self.state.settings.grpc_stream_max_in_flight
        slots = asyncio.Semaphore(in_flight)
        # Answers not yet taken by the client: at most as many (the stream's end takes none).
        room = asyncio.Semaphore(in_flight)
        under_way: set[asyncio.Task[None]] = set()
        activity = StreamActivity()

        async def send(answer_bytes: bytes) -> None:
            await room.acquire()
            answers.put_nowait(answer_bytes)

        async def answer(message: bytes, turn: QueueTurn, reservation: BodyReservation) -> None:
            try:
                last = await self._stream_answer(message, metadata, send, turn)
                if last:
                    await send(last)
            finally:
                reservation.release()
                turn.done.set()  # (failed before it was queued: the next one may go)
                slots.release()
                activity.ended()

        async def read() -> None:
            before: asyncio.Event | None = None
            idle_s = self.limits.stream_idle_s
            try:
                while (message := await next_message(context, activity, idle_s)) is not None:
                    reservation = self.state.bodies.reservation()
                    try:
                        reservation.ensure(len(message))
                    except ServerBusy as exc:
                        await send(_stream_error(request_id_of(message), exc.message))
                        continue
                    try:
                        await slots.acquire()
                    except BaseException:
                        reservation.release()
                        raise
                    turn = QueueTurn(before)
                    before = turn.done
                    activity.began()
                    task = asyncio.create_task(answer(message, turn, reservation))
                    under_way.add(task)
                    task.add_done_callback(under_way.discard)
                while under_way:
                    await asyncio.gather(*under_way, return_exceptions=True)
            finally:
                answers.put_nowait(None)

        reader = asyncio.create_task(read())
        try:
            while (answer_bytes := await answers.get()) is not None:
                yield answer_bytes  # (returns once the client's transport took it)
                room.release()
            try:
                await reader  # (re-raises what ended the reading, a cancelled call's error)
            except SluiceError as exc:  # (an idle stream)
                _fail(context, exc)
        finally:
            reader.cancel()
            for task in list(under_way):
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.gather(reader, *under_way, return_exceptions=True)

    async def _stream_answer(
        self,
        message: bytes,
        metadata: dict[str, str],
        sink: Sink,
        turn: QueueTurn,
    ) -> bytes:
        """One stream response: the answer, or the error with the request's id (a
        decoupled model's responses go to ``sink`` as they come, and this is empty)."""
        request: Any = None
        try:
            on_thread = decoded_on_thread(message)
            request = await self.decode(message, on_thread)
            return await self.infer(
                request, len(message), metadata, None, sink=sink, turn=turn, on_thread=on_thread
            )
        except Exception as exc:
            code, details = status_of(exc)
            _log_failure(code, details)
            return _stream_error(
                request.id if request is not None else request_id_of(message), details
            )

    async def decode(self, message: bytes, on_thread: bool) -> Any:
        """The ``ModelInferRequest`` (decoded on a thread when ``on_thread``: see
        :mod:`.offload`), once its entries are counted (:mod:`.entry_counts`)."""
        limits = self.state.limits
        if on_thread:
            return await asyncio.to_thread(_decode, message, limits)
        return _decode(message, limits)

    async def infer(
        self,
        request: Any,
        size: int,
        metadata: dict[str, str],
        remaining_s: float | None,
        *,
        sink: Sink | None = None,
        turn: QueueTurn | None = None,
        on_thread: bool,
    ) -> bytes:
        """One decoded request of ``size`` bytes (already charged to the body budget by the
        caller; parsed on a thread when ``on_thread``), checked, queued, answered: the
        ``ModelInferResponse`` bytes (with a stream's ``sink``: the
        ``ModelStreamInferResponse`` bytes holding it, or, for a decoupled model, each of its
        responses given to ``sink`` and b""); raises what the client is to see. With tracing
        on, the call is a ``receive`` span of its own (:mod:`sluice.core.observability.otel`),
        the parent of what the request makes."""
        model, version = request.model_name, request.model_version or None
        if len(model) > self.state.limits.max_string_length or len(version or "") > 64:
            raise InvalidInput("'model_name' or 'model_version' is too long")
        request_id.from_header(metadata.get("x-request-id"))
        if self.forward is not None:
            FORWARDED.set(matching(self.forward, metadata.items()))
        label = metadata.get(_LABEL_METADATA) or None
        trace = _trace_of(metadata)
        tracing = self.state.tracing
        span = None
        if tracing is not None:
            method = "ModelStreamInfer" if sink is not None else "ModelInfer"
            span = tracing.receive(model, trace, rpc_method=method)
            trace = span.context
        if trace is not None:
            TRACE_ID.set(trace.trace_id)
        infer = functools.partial(self._infer, request, size, on_thread, remaining_s, label, trace)
        if span is None:
            return await infer(None, sink, turn)
        try:
            answer = await infer(span, sink, turn)
        except asyncio.CancelledError:
            span.end_call(None, request_id.current(), "the client went away")
            raise
        except Exception as exc:
            code, details = describe(exc)
            span.end_call(code.value[0], request_id.current(), details)
            raise
        span.end_call(grpc.StatusCode.OK.value[0], request_id.current())
        return answer

    async def _infer(
        self,
        request: Any,
        size: int,
        on_thread: bool,
        remaining_s: float | None,
        label: str | None,
        trace: TraceParent | None,
        span: RequestSpan | None,
        sink: Sink | None,
        turn: QueueTurn | None,
    ) -> bytes:
        stream = sink is not None
        state = self.state
        big = size > OFFLOAD_BYTES
        model, version = request.model_name, request.model_version or None
        limits = state.limits

        def parse(config: ModelConfig) -> InferRequest:
            document, binary = request_document(request)
            return parse_infer_document(document, binary, config, limits, state.regions)

        heavy = on_thread or _names_shm_bytes(request)
        deadline_us = 0 if remaining_s is None else max(1, int(remaining_s * 1_000_000))
        prepared = await prepare_with(
            state,
            model,
            version,
            parse,
            heavy,
            label,
            deadline_us=deadline_us,
        )
        parsed, transfer = prepared.parsed, state.transfer

        def encode(reply: ReplyMessage, data: memoryview) -> bytes:
            answer = _encode(transfer, model, reply, data, parsed)
            if not stream:
                return answer
            # The stream response's field 2 is the ModelInferResponse: its bytes, framed.
            return b"".join((_STREAM_FIELD, varint(len(answer)), answer))

        if sink is not None and prepared.decoupled:
            if turn is not None:  # (a decoupled model's requests keep no order)
                turn.done.set()
            empty_final = request.parameters.get(_EMPTY_FINAL)
            await _decoupled(
                state,
                prepared,
                big,
                encode,
                trace,
                sink,
                empty_final is not None and empty_final.bool_param,
            )
            return b""
        return await execute(
            state,
            prepared,
            big,
            encode,
            trace,
            span,
            endpoint="ModelInfer RPC",
            turn=turn,
        )


async def _decoupled(
    state: GatewayState,
    prepared: Prepared,
    big: bool,
    encode: Callable[[ReplyMessage, memoryview], bytes],
    trace: TraceParent | None,
    sink: Sink,
    empty_final: bool,
) -> None:
    """A decoupled model's responses on a stream. With the request's
    ``triton_enable_empty_final_response``, each carries Triton's ``triton_final_response``
    parameter and a final response without outputs is sent too (empty), as Triton does."""
    async for reply, answer in execute_stream(state, prepared, big, encode, trace):
        if answer is None:
            if empty_final:
                response = service_pb2.ModelStreamInferResponse()
                response.infer_response.model_name = prepared.model
                response.infer_response.model_version = str(reply.model_version)
                response.infer_response.id = prepared.parsed.id
                response.infer_response.parameters[_FINAL].bool_param = True
                await sink(bytes(response.SerializeToString()))
            continue
        if empty_final:
            flag = service_pb2.ModelInferResponse()
            flag.parameters[_FINAL].bool_param = reply.final
            # Protocol buffers merge concatenated messages: the answer gains the parameter.
            field = flag.SerializeToString()
            answer = answer + _STREAM_FIELD + varint(len(field)) + field
        await sink(answer)


def _stream_error(request_id: str, details: str) -> bytes:
    response = service_pb2.ModelStreamInferResponse(error_message=details)
    response.infer_response.id = request_id
    return bytes(response.SerializeToString())


def _fail(context: grpc.aio.ServicerContext[bytes, bytes], exc: Exception) -> None:
    """End the call with the error's status once the handler returns.

    Not ``context.abort``: grpcio keeps the exception abort raises on the call's state, and
    its traceback leads back to that state, a cycle that keeps the finished call (and the
    request bytes grpcio still holds for it) until a full garbage collection, hundreds of
    MiB after a flood of refused large messages.
    """
    code, details = status_of(exc)
    _log_failure(code, details)
    context.set_code(code)
    context.set_details(details)


def _names_shm_bytes(request: Any) -> bool:
    """A BYTES input in a shared memory region is read and counted while parsed: such a
    request may be heavy whatever its size."""
    return any(
        tensor.datatype == "BYTES" and _SHM in tensor.parameters for tensor in request.inputs
    )


def _decode(message: bytes, limits: RequestLimits) -> Any:
    check_entry_counts(message, limits)
    try:
        return service_pb2.ModelInferRequest.FromString(message)
    except DecodeError as exc:
        raise InvalidInput(f"malformed ModelInferRequest: {exc}") from None


def _encode(
    transfer: TensorTransfer,
    model: str,
    reply: ReplyMessage,
    data: memoryview,
    parsed: InferRequest,
) -> bytes:
    outputs = transfer.unpack(reply.outputs, data, parsed.outputs)
    return encode_response(model, str(reply.model_version), parsed.id, outputs, reply.parameters)


def _trace_of(metadata: dict[str, str]) -> TraceParent | None:
    traceparent = metadata.get("traceparent")
    if traceparent is None:
        return None
    return parse_traceparent(traceparent, metadata.get("tracestate"))


_STREAM_FIELD = bytes([(2 << 3) | 2])  # ModelStreamInferResponse.infer_response, length-delimited


def _log_failure(code: grpc.StatusCode, details: str) -> None:
    level = logging.WARNING if code is grpc.StatusCode.INTERNAL else logging.DEBUG
    request_id.current()
    log.log(level, "gRPC inference request failed: %s %s", code.name, details)
