"""Requests a worker makes of other models: an ensemble's steps, a Python model's BLS calls.

A request is queued on the called model's stream exactly as the gateway queues a client's
(a :class:`sluice.core.wire.RequestMessage` whose payload is the tensors in Triton's binary
layout), and its answer comes back on a reply stream of this process's own. The calls run
on an event loop of their own, on a thread owned by :class:`ModelCalls` with its own Redis
clients, so that a backend's compute threads (which are not event-loop threads) can wait
for them: :meth:`ModelCalls.submit` on the loop, through :meth:`ModelCalls.call_soon` from
another thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import uuid
from collections.abc import AsyncIterator, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from sluice.core.clock import CLOCK
from sluice.core.config import ModelConfig
from sluice.core.control import (
    NOT_ALLOWED,
    ControlCommand,
    await_answers,
    encode_command,
    live_executors_async,
)
from sluice.core.datatypes import from_numpy_dtype, to_buffer, to_numpy
from sluice.core.dispatch import RedisDispatcher
from sluice.core.errors import (
    DeadlineExceeded,
    InferenceFailed,
    InvalidInput,
    Unavailable,
    error_from_kind,
)
from sluice.core.keys import Keys, tenant_stream
from sluice.core.observability.trace_context import TraceParent
from sluice.core.queue_streams import REGISTER, TenantStreams
from sluice.core.redis_client.connect import connect_async
from sluice.core.response_cache import CacheLookup, ResponseCache
from sluice.core.sequences import (
    FLAG_SEQUENCE_END,
    FLAG_SEQUENCE_START,
    batch_size_problem,
    sequence_of,
)
from sluice.core.settings import WorkerSettings
from sluice.core.targets import Target, TargetResolver
from sluice.core.wire import ReplyMessage, RequestMessage, TensorHeader
from sluice.workers.backends.base import Answered

_STREAM_MAX_LEN = 100_000
"""Approximate cap on a request stream (the gateway's default ``SLUICE_STREAM_MAX_LEN``),
a safety net only: workers delete entries once answered."""
DEFAULT_TIMEOUT_S = 60.0
"""A call's deadline when the request it serves carries none (the gateway always gives one)."""
_OFFLOAD_BYTES = 1 << 20
"""A call's payload (or answer) larger than this is hashed (or packed) for the response
cache off the calls' event loop."""
_TOUCH_S = 60.0
"""How often the reply stream's time to live is renewed."""
_CONTROL_POLL_S = 0.05
"""How often a load or unload's answer is looked for (loads are rare and take seconds)."""

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class CallContext:
    """What a call inherits from the request it serves: its deadline, ids and tenant."""

    request_id: str = ""
    deadline_ns: int = 0
    """Unix ns; 0: :data:`DEFAULT_TIMEOUT_S` from now."""
    trace: TraceParent | None = None
    sequence: tuple[int | str, int] = (0, 0)
    """The correlation id and flags the call carries (0, 0: none); a sequence model's call
    must name its sequence, and goes to the instance that holds it."""
    parameters: Mapping[str, Any] = field(default_factory=dict)
    """The call's own request parameters (an ensemble's request's, a BLS request's)."""
    tenant: str = ""
    """Whose request the call serves (empty: the anonymous tenant); the call is theirs."""
    shared: bool = False
    """The call serves several tenants' requests at once (a Python model's call made while
    it computes a batch that mixes tenants): it is made as the anonymous tenant, and bypasses
    the response cache, whose answers are each one tenant's."""


def cached(config: ModelConfig, context: CallContext) -> bool:
    """Whether a call to a model of ``config`` is looked up in the response cache (and its
    answer kept there): the model enables it, its answers depend on the request alone (not
    a sequence's state, not a decoupled model's stream), and the call is one tenant's."""
    return (
        config.response_cache
        and config.sequence_batching is None
        and not config.decoupled
        and not context.shared
    )


class ModelCalls:
    def __init__(self, caller: str, settings: WorkerSettings | None = None) -> None:
        """``caller`` names this process's reply stream (for operators reading Redis)."""
        self._settings = settings or WorkerSettings()
        self._caller = caller
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=caller, daemon=True)
        self._thread.start()
        try:
            self.call_soon(self._open())
        except BaseException:
            self.close()
            raise

    def call_soon(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Run ``coroutine`` on the calls' loop and wait for it (from another thread)."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()

    async def _open(self) -> None:
        settings = self._settings
        self._redis = connect_async(settings.redis_url, socket_timeout=10)
        self._reader = connect_async(settings.redis_url)
        keys = self._keys = Keys(settings.namespace)
        self._dispatcher = RedisDispatcher(
            self._redis, self._reader, keys, stream_max_len=_STREAM_MAX_LEN, caller=self._caller
        )
        self._targets = TargetResolver(self._redis, keys)
        self._tenant_streams = TenantStreams()
        self._cache = ResponseCache.from_settings(self._redis, keys, settings, settings.redis_url)
        self._register = self._redis.register_script(REGISTER)
        await self._dispatcher.start()
        self._toucher = asyncio.create_task(self._touch())

    async def _touch(self) -> None:
        while True:
            with contextlib.suppress(Exception):
                await self._dispatcher.touch()
            await asyncio.sleep(_TOUCH_S)

    async def _shut(self) -> None:
        toucher = getattr(self, "_toucher", None)
        if toucher is not None:
            toucher.cancel()
        dispatcher = getattr(self, "_dispatcher", None)
        if dispatcher is not None:
            await dispatcher.stop()
        for client in (getattr(self, "_redis", None), getattr(self, "_reader", None)):
            if client is not None:
                await client.aclose()

    def close(self) -> None:
        if self.loop.is_running():
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(self._shut(), self.loop).result(timeout=5)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=5)

    async def submit(
        self,
        model: str,
        version: int,
        inputs: Sequence[tuple[str, str, np.ndarray]],
        outputs: Sequence[str],
        context: CallContext,
    ) -> dict[str, np.ndarray]:
        """The ``outputs`` of ``model`` (``version`` -1: the latest ready; no outputs: all of
        them) for ``inputs`` ((name, datatype, array) each; datatype "": the one the model's
        config gives the input); raises the error the model answered."""
        target, stream, message, payload, timeout_s = await self._request(
            model, version, inputs, outputs, context
        )
        cache = self._cache if cached(target.config, context) else None
        if cache is None:
            submitted = self._dispatcher.submit(model, stream, message, payload, timeout_s)
            return _answer(*await submitted)
        # Triton's response cache serves a model's calls as it serves its clients.
        stats = self._keys.stats(target.model, target.version)
        lookup = await CacheLookup.start(
            cache,
            context.tenant,
            target.model,
            target.version,
            target.revision,
            message,
            payload,
            False,
            _OFFLOAD_BYTES,
        )
        if lookup.hit is not None:
            await lookup.counted(stats)
            return _answer(*lookup.hit)
        reply, data = await self._dispatcher.submit(model, stream, message, payload, timeout_s)
        if not reply.error_kind:
            await lookup.keep(reply, data, _OFFLOAD_BYTES, stats)
        return _answer(reply, data)

    async def submit_stream(
        self,
        model: str,
        version: int,
        inputs: Sequence[tuple[str, str, np.ndarray]],
        outputs: Sequence[str],
        context: CallContext,
    ) -> AsyncIterator[tuple[dict[str, np.ndarray], bool]]:
        """:meth:`submit` for a decoupled model: each of its responses as it comes, with
        whether it is the final one, until the final one (another model's one answer);
        raises the error the model answered. Closing the iterator early withdraws the
        request."""
        _target, stream, message, payload, timeout_s = await self._request(
            model, version, inputs, outputs, context
        )
        replies = self._dispatcher.submit_stream(model, stream, message, payload, timeout_s)
        async for reply, data in replies:
            yield _answer(reply, data), reply.final

    async def _request(
        self,
        model: str,
        version: int,
        inputs: Sequence[tuple[str, str, np.ndarray]],
        outputs: Sequence[str],
        context: CallContext,
    ) -> tuple[Target, str, RequestMessage, bytes, float]:
        """The target, stream, request, payload and timeout of a call."""
        target = await self._targets.resolve(model, version)
        parameters = {**context.parameters, **sequence_parameters(*context.sequence)}
        stream = target.stream
        if target.config.sequence_batching is not None:
            stream = self._sequence_stream(target, parameters, inputs)
        elif context.tenant:
            # The tenant's own stream of the level, as the gateway appends its requests:
            # the called model shares its time between tenants (workers.fair_share).
            stream = tenant_stream(stream, context.tenant)
            await self._tenant_streams.ensure(
                self._register, self._keys, target.model, target.version, stream
            )
        now_ns = CLOCK.now_ns()
        deadline_ns = context.deadline_ns or now_ns + int(DEFAULT_TIMEOUT_S * 1e9)
        timeout_s = (deadline_ns - now_ns) / 1e9
        if timeout_s <= 0:
            raise DeadlineExceeded(f"the deadline passed before the request to '{model}' went")
        headers: list[TensorHeader] = []
        buffers: list[bytes | memoryview] = []
        for name, datatype, array in inputs:
            if not datatype:
                spec = target.config.input(name)
                datatype = spec.datatype if spec is not None else from_numpy_dtype(array.dtype)
            buffer = to_buffer(datatype, array)
            headers.append(TensorHeader(name, datatype, tuple(array.shape), len(buffer)))
            buffers.append(buffer)
        message = RequestMessage(
            request_key="",
            reply_to="",
            inputs=headers,
            outputs=list(outputs) or [spec.name for spec in target.config.outputs],
            client_id=context.request_id,
            deadline_ns=deadline_ns,
            enqueued_ns=now_ns,
            priority=0,
            request_id=context.request_id or uuid.uuid4().hex,
            trace=context.trace,
            parameters=parameters,
            tenant=context.tenant,
        )
        return target, stream, message, b"".join(buffers), timeout_s

    async def model_ready(self, model: str, version: int) -> bool:
        """Whether ``model`` (``version`` -1: any version) has a live instance now."""
        return await self._targets.ready(model, version)

    async def control(self, command: ControlCommand, timeout_s: float) -> None:
        """Have the executor carry out a load or unload (explicit model control only) and
        wait for it; raises :class:`InvalidInput` with the reason it failed,
        :class:`Unavailable` when model control is not explicit or it takes too long."""
        redis, keys = self._redis, self._keys
        if await redis.get(keys.control_mode) != b"explicit":
            raise Unavailable(f"{NOT_ALLOWED} (sluice up --model-control-mode explicit)")
        fields = await asyncio.to_thread(encode_command, command)
        expected = await live_executors_async(redis, keys)
        await redis.xadd(keys.control_requests, fields)  # type: ignore[arg-type]
        reply_key = keys.control_reply(command.command_id)

        async def take() -> bytes | None:
            raw = await redis.lpop(reply_key)
            return raw if isinstance(raw, bytes) else None

        answers = await await_answers(
            take,
            lambda: live_executors_async(redis, keys),
            expected,
            timeout_s,
            _CONTROL_POLL_S,
        )
        if answers is None:
            raise Unavailable(
                f"the {command.op} of '{command.model}' did not finish within {timeout_s:.0f} s"
            )
        self._targets.forget(command.model)
        if answers.error:
            raise InvalidInput(answers.error)

    def _sequence_stream(
        self,
        target: Target,
        parameters: dict[str, Any],
        inputs: Sequence[tuple[str, str, np.ndarray]],
    ) -> str:
        """The stream of the instance that holds the call's sequence (Triton's errors for a
        call that names none, or a batch of more than one)."""
        ref = sequence_of(parameters, target.model)
        if target.config.max_batch_size > 0 and any(
            array.ndim == 0 or array.shape[0] != 1 for _, _, array in inputs
        ):
            raise batch_size_problem(target.model)
        slot = ref.slot(target.config.total_instances)
        return self._keys.sequence_stream(target.model, target.version, slot)


def sequence_parameters(correlation_id: int | str, flags: int) -> dict[str, Any]:
    """The request parameters that carry a correlation id and flags (none for 0)."""
    if correlation_id == 0 or correlation_id == "":
        return {}
    return {
        "sequence_id": correlation_id,
        "sequence_start": bool(flags & FLAG_SEQUENCE_START),
        "sequence_end": bool(flags & FLAG_SEQUENCE_END),
    }


def _answer(reply: ReplyMessage, data: memoryview) -> Answered:
    """The tensors of a called model's answer, with its response's parameters; raises the
    error it answered instead."""
    if reply.error_kind:
        raise error_from_kind(reply.error_kind, reply.error)
    return Answered(answer_tensors(reply.outputs, data), reply.parameters)


def answer_tensors(outputs: Sequence[TensorHeader], data: memoryview) -> dict[str, np.ndarray]:
    """The tensors of an answer whose outputs all came inline."""
    answer: dict[str, np.ndarray] = {}
    offset = 0
    for header in outputs:
        if header.shm is not None:  # never asked for: every output comes inline
            raise InferenceFailed(f"output '{header.name}' came in shared memory")
        chunk = data[offset : offset + header.nbytes]
        offset += header.nbytes
        answer[header.name] = to_numpy(header.datatype, header.shape, chunk)
    return answer


_PROCESS_CALLS: ModelCalls | None = None
_PROCESS_CALLS_LOCK = threading.Lock()


def process_calls() -> ModelCalls:
    """This process's :class:`ModelCalls` for Python models' calls (BLS), opened at the
    first call and shared by every model instance of the process."""
    global _PROCESS_CALLS
    with _PROCESS_CALLS_LOCK:
        if _PROCESS_CALLS is None:
            _PROCESS_CALLS = ModelCalls(f"bls-{os.getpid()}-")
        return _PROCESS_CALLS
