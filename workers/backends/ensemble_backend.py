"""Ensembles (``platform: "ensemble"``): a graph of steps, each a request to another model.

A request's inputs are the first ensemble tensors. Each step is queued on its composing
model's stream, exactly as the gateway queues a client's request (a
:class:`sluice.core.wire.RequestMessage` whose payload is the tensors in Triton's binary
layout), as soon as every tensor it reads exists; steps that do not depend on each other
run at the same time. What a step answers becomes the ensemble tensors its
``output_map`` names, read by later steps; the ensemble's requested outputs are the
answer. Intermediate tensors go from worker to worker through Redis, never through a
gateway. Each step inherits the request's deadline, request id and trace context, so
the composing models count, trace and expire it as one of their own requests.

An instance spends its time waiting for its composing models, so it declares
``concurrency`` (:mod:`sluice.workers.slots`): the worker computes up to that many batches at
once, each on a thread of its own, which hands the request to this backend's event loop
(:class:`sluice.workers.model_calls.ModelCalls`: a thread with its own Redis clients and reply
stream) and waits.
Each step additionally has at most :data:`STEP_IN_FLIGHT` requests in flight (or the
config's ``max_inflight_requests``: :func:`step_in_flight`), so that one
slow composing model cannot collect an unbounded queue from one ensemble instance.

A failing step fails the request with the step's error class (so the same HTTP status and
gRPC code) and a message naming the ensemble, the step and its model.

As in Triton (:mod:`sluice.workers.backends.ensemble_graph`): a request runs only the steps
that lead to the outputs it asks for; a tensor crossing from a non-batching model (or
ensemble) to a batching one gains a batch dimension of 1, and loses it on the way back; an
output a composing model did not produce is left out of the answer (a step that reads it
gets no such input, which fails it only when the input is required).
"""

from __future__ import annotations

import asyncio
import logging
import queue
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from concurrent.futures import CancelledError, Future
from pathlib import Path
from typing import Any

import numpy as np

from sluice.core.config import ModelConfig
from sluice.core.errors import (
    Cancelled,
    InferenceFailed,
    InvalidConfig,
    InvalidInput,
    SluiceError,
)
from sluice.core.placement import Placement
from sluice.core.settings import DEFAULT_MAX_BATCH_SIZE
from sluice.workers.backends.base import Emit, RequestContext, RequestsFailed
from sluice.workers.backends.ensemble_check import composing_configs
from sluice.workers.backends.ensemble_graph import Carried, fit_shape, live_steps
from sluice.workers.backends.ensemble_join import join_requests, split_requests
from sluice.workers.backends.ensemble_stream import EnsembleStream, StepBound
from sluice.workers.model_calls import CallContext, ModelCalls

log = logging.getLogger(__name__)

CONCURRENCY = 64
"""Batches one ensemble instance runs at once. An instance holds nothing per request but
its tensors, and waits on other models: 64 keeps a few instances' worth of composing
models busy (as Triton's ensemble scheduler keeps every request in flight) while bounding
the threads and the memory of one worker process."""

STEP_IN_FLIGHT = 64
"""Requests one instance has queued on one step's model at once (the same bound)."""


def step_in_flight(config: ModelConfig) -> int:
    """Requests one instance has in flight to each step's model: Triton's
    ``ensemble_scheduling.max_inflight_requests`` where it is set (0, its default, means no
    limit in Triton; here :data:`STEP_IN_FLIGHT`, as one instance keeps a thread per batch)."""
    scheduling = config.raw.get("ensemble_scheduling") or {}
    try:
        asked = int(scheduling.get("max_inflight_requests") or 0)
    except (TypeError, ValueError):
        asked = 0
    return asked if asked > 0 else STEP_IN_FLIGHT


Slot = Callable[[str], "asyncio.Future[Carried]"]


class EnsembleBackend:
    concurrency = CONCURRENCY

    def __init__(
        self,
        config: ModelConfig,
        model_path: Path,
        placement: Placement,
        config_name: str = "",
        default_max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
    ) -> None:
        """``model_path`` is the version folder (``<repository>/<ensemble>/<version>``);
        the composing models are read with the custom configuration ``config_name`` and
        autocomplete's ``default_max_batch_size``."""
        del placement  # an ensemble computes nothing itself
        repository = model_path.parent.parent
        steps = composing_configs(
            config, repository, config_name, default_max_batch_size=default_max_batch_size
        )
        self.setup(config, steps)
        self._calls = ModelCalls(f"ensemble-{config.name}-")

    def setup(self, config: ModelConfig, step_configs: list[ModelConfig]) -> None:
        """The graph of ``config`` whose steps call models configured as ``step_configs``."""
        self.config = config
        self.steps = config.ensemble_steps
        self.step_configs = step_configs
        self.in_flight = step_in_flight(config)
        self._limits = [StepBound(self.in_flight) for _ in self.steps]
        self._live: dict[frozenset[str], frozenset[int]] = {}

    def close(self) -> None:
        self._calls.close()

    # -- Backend ---------------------------------------------------------------------------

    def infer(
        self,
        inputs: Mapping[str, np.ndarray],
        outputs: Sequence[str],
        request_sizes: Sequence[int] | None = None,
        contexts: Sequence[RequestContext] | None = None,
    ) -> dict[str, np.ndarray]:
        """Each request of the batch goes through the graph on its own (as Triton's
        ensemble scheduler handles requests one by one); the answers are joined again."""
        sizes = list(request_sizes or [1])
        parts, contexts, batches = self._requests(inputs, sizes, contexts)
        futures = [  # each request asks for its own outputs (its steps alone run)
            asyncio.run_coroutine_threadsafe(
                self.run(part, context.outputs or outputs, context, batch), self._calls.loop
            )
            for part, context, batch in zip(parts, contexts, batches, strict=True)
        ]
        for future, context in zip(futures, contexts, strict=True):
            if context.cancelled is not None:  # its steps' requests are withdrawn in turn
                context.cancelled.add(future.cancel)
        answers: list[dict[str, np.ndarray]] = []
        failures: dict[int, SluiceError] = {}
        for index, future in enumerate(futures):
            try:
                answers.append(future.result())
            except SluiceError as exc:
                failures[index] = exc
                answers.append({})
            except CancelledError:
                failures[index] = Cancelled("the request was cancelled while its steps ran")
                answers.append({})
            except Exception as exc:
                failures[index] = InferenceFailed(f"{type(exc).__name__}: {exc}")
                answers.append({})
        if len(parts) == 1:
            if failures:
                raise failures[0]
            return answers[0]
        joined = join_requests(answers, sizes, outputs, failures)
        if failures:
            raise RequestsFailed(failures, joined)
        assert joined is not None
        return joined

    def infer_stream(
        self,
        inputs: Mapping[str, np.ndarray],
        outputs: Sequence[str],
        request_sizes: Sequence[int] | None,
        emit: Emit,
        contexts: Sequence[RequestContext] | None = None,
    ) -> None:
        """A decoupled ensemble's batch (:mod:`sluice.workers.backends.ensemble_stream`):
        each request's responses are handed to ``emit`` as they come, on this (compute)
        thread, while the requests run on the calls' event loop."""
        sizes = list(request_sizes or [1])
        parts, contexts, batches = self._requests(inputs, sizes, contexts)
        events: queue.SimpleQueue[tuple[int, Any, bool]] = queue.SimpleQueue()
        for index, (part, context, batch) in enumerate(zip(parts, contexts, batches, strict=True)):
            partial, ended = _handing(events, index)
            stream = EnsembleStream(self, context.outputs or outputs, context, partial)
            future = asyncio.run_coroutine_threadsafe(stream.run(part, batch), self._calls.loop)
            future.add_done_callback(ended)  # (once the run has ended: after its responses)
            if context.cancelled is not None:  # its steps' requests are withdrawn in turn
                context.cancelled.add(future.cancel)
        running = len(parts)
        while running:
            index, item, last = events.get()
            if not last:
                emit(index, item, False)
                continue
            running -= 1
            emit(index, _last_response(item), True)

    def _requests(
        self,
        inputs: Mapping[str, np.ndarray],
        sizes: list[int],
        contexts: Sequence[RequestContext] | None,
    ) -> tuple[list[dict[str, np.ndarray]], Sequence[RequestContext], list[int]]:
        """The batch's requests: each one's inputs, context and batch size (0: the
        ensemble does not batch)."""
        batching = self.config.max_batch_size > 0
        parts = split_requests(inputs, sizes, batching)
        if contexts is None or len(contexts) != len(parts):
            contexts = [RequestContext("", 0, None)] * len(parts)
        batches = list(sizes) if batching else [0] * len(parts)
        if batching and len(parts) == 1:
            batches = [_batch_of(parts[0]) or sizes[0]]
        return parts, contexts, batches

    # -- one request -----------------------------------------------------------------------

    def live(self, outputs: Sequence[str]) -> frozenset[int]:
        """The steps a request for ``outputs`` runs (:func:`live_steps`, remembered)."""
        key = frozenset(outputs)
        found = self._live.get(key)
        if found is None:
            found = live_steps(self.config, key)
            if len(self._live) < 256:  # (at most one entry per set of outputs asked)
                self._live[key] = found
        return found

    async def run(
        self,
        inputs: Mapping[str, np.ndarray],
        outputs: Sequence[str],
        context: RequestContext,
        batch: int = 0,
    ) -> dict[str, np.ndarray]:
        """The requested ensemble outputs of one request (those its composing models made).
        ``batch``: the request's batch size (0: the ensemble does not batch)."""
        loop = asyncio.get_running_loop()
        tensors: dict[str, asyncio.Future[Carried]] = {}

        def slot(name: str) -> asyncio.Future[Carried]:
            if name not in tensors:
                tensors[name] = loop.create_future()
            return tensors[name]

        for spec in self.config.inputs:  # an optional input not given: no tensor
            slot(spec.name).set_result(Carried(inputs.get(spec.name), batch))
        for name, array in inputs.items():
            if not slot(name).done():
                slot(name).set_result(Carried(array, batch))
        tasks = [
            asyncio.create_task(self._step(index, slot, context))
            for index in sorted(self.live(outputs))
        ]
        try:
            wanted = [slot(name) for name in outputs]
            pending: set[asyncio.Future[Any]] = {*tasks, *wanted}
            while not all(future.done() for future in wanted):
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for future in done:
                    error = future.exception() if future in tasks else None
                    if error is not None:
                        raise error
            return self.answer(outputs, [future.result() for future in wanted])
        finally:
            for task in tasks:
                task.cancel()
            for future in tensors.values():
                if not future.done():
                    future.cancel()

    def answer(self, outputs: Sequence[str], made: Sequence[Carried]) -> dict[str, np.ndarray]:
        """The outputs that were made, shaped as the ensemble answers them (a non-batching
        ensemble's output made by a batching model loses its batch dimension of 1)."""
        batching = self.config.max_batch_size > 0
        answer: dict[str, np.ndarray] = {}
        for name, carried in zip(outputs, made, strict=True):
            if carried.array is None:
                continue
            spec = self.config.output(name)
            assert spec is not None  # (the worker checked the request's outputs)
            dims = spec.dims if spec.reshape is None else spec.reshape
            shape = fit_shape(dims, batching, carried.batch, carried.array.shape)
            answer[name] = carried.array.reshape(shape)
        return answer

    async def _step(self, index: int, slot: Slot, context: RequestContext) -> None:
        step = self.steps[index]
        carried = {tensor: await slot(tensor) for tensor in step.input_map.values()}
        reads, batch = self.inputs_of(index, carried, context)
        try:
            async with self._limits[index]:
                answer = await self.submit(index, reads, context)
        except SluiceError as exc:
            raise type(exc)(f"{self.where(index)}: {exc.message}") from None
        for name, tensor in step.output_map.items():
            slot(tensor).set_result(Carried(answer.get(name), batch))

    # -- what a step's request is (also for decoupled ensembles: ensemble_stream) ----------

    def where(self, index: int) -> str:
        """How errors name step ``index``."""
        model = self.steps[index].model_name
        return f"in ensemble '{self.config.name}', step {index} (model '{model}')"

    def inputs_of(
        self, index: int, carried: Mapping[str, Carried], context: RequestContext
    ) -> tuple[dict[str, np.ndarray], int]:
        """Step ``index``'s inputs from the ensemble tensors it reads (``carried``), shaped
        for its model, and their batch size (0: its model does not batch); raises
        :class:`InvalidInput` when a required one was not made."""
        step, model = self.steps[index], self.step_configs[index]
        batching = model.max_batch_size > 0
        reads: dict[str, np.ndarray] = {}
        for name, tensor in step.input_map.items():
            value = carried[tensor]
            if value.array is None:
                continue
            spec = model.input(name)
            assert spec is not None  # checked when the ensemble loaded
            shape = fit_shape(spec.dims, batching, value.batch, value.array.shape)
            reads[name] = value.array.reshape(shape)
        missing = [s.name for s in model.inputs if not s.optional and s.name not in reads]
        if missing:
            raise InvalidInput(
                f"{self.where(index)}: {_missing_inputs(model, reads, missing, context)}"
            )
        return reads, _batch_of(reads) if batching else 0

    def limit(self, index: int) -> StepBound:
        """Bounds the requests in flight to step ``index``'s model (:data:`STEP_IN_FLIGHT`)."""
        return self._limits[index]

    async def submit(
        self, index: int, reads: dict[str, np.ndarray], context: RequestContext
    ) -> dict[str, np.ndarray]:
        """Step ``index``'s answer to ``reads``."""
        step = self.steps[index]
        return await self._calls.submit(
            step.model_name,
            step.model_version,
            self._inputs(index, reads),
            list(step.output_map),
            _call_context(context),
        )

    def submit_stream(
        self, index: int, reads: dict[str, np.ndarray], context: RequestContext
    ) -> AsyncIterator[tuple[dict[str, np.ndarray], bool]]:
        """Step ``index``'s responses to ``reads`` (a decoupled model), with whether each
        is the final one."""
        step = self.steps[index]
        return self._calls.submit_stream(
            step.model_name,
            step.model_version,
            self._inputs(index, reads),
            list(step.output_map),
            _call_context(context),
        )

    def _inputs(self, index: int, reads: dict[str, np.ndarray]) -> list[tuple[str, str, Any]]:
        model = self.step_configs[index]
        inputs = []
        for name, array in reads.items():
            spec = model.input(name)
            assert spec is not None  # checked when the ensemble loaded
            inputs.append((name, spec.datatype, array))
        return inputs


def _handing(
    events: queue.SimpleQueue[tuple[int, Any, bool]], index: int
) -> tuple[Callable[[dict[str, np.ndarray]], None], Callable[[Future[Any]], None]]:
    """How request ``index``'s run hands its responses, then its end, to the compute thread."""

    def partial(answer: dict[str, np.ndarray]) -> None:
        events.put((index, answer, False))

    def ended(run: Future[Any]) -> None:
        events.put((index, run, True))

    return partial, ended


def _last_response(
    run: Future[dict[str, np.ndarray] | None],
) -> dict[str, np.ndarray] | SluiceError | None:
    """What ends a decoupled ensemble request's responses: its last one (None: a final
    response without outputs), or the error that ended it."""
    if run.cancelled():
        return Cancelled("the request was cancelled while its steps ran")
    error = run.exception()
    if error is None:
        return run.result()
    if isinstance(error, SluiceError):
        return error
    return InferenceFailed(f"{type(error).__name__}: {error}")


def _call_context(context: RequestContext) -> CallContext:
    return CallContext(
        context.request_id,
        context.deadline_ns,
        context.trace,
        context.sequence,
        context.parameters,
        context.tenant,
    )


def _batch_of(tensors: Mapping[str, np.ndarray]) -> int:
    """The batch size of a request to a batching model: its inputs' first dimension."""
    for array in tensors.values():
        if array.ndim:
            return int(array.shape[0])
    return 0


def _missing_inputs(
    model: ModelConfig,
    reads: Mapping[str, np.ndarray],
    missing: list[str],
    context: RequestContext,
) -> str:
    """Triton's text for a step request that lacks required inputs (a composing model
    before it did not produce them)."""
    total = len(model.inputs)
    required = total - sum(spec.optional for spec in model.inputs)
    expected = (
        f"expected {total} inputs"
        if required == total
        else f"expected number of inputs between {required} and {total}"
    )
    got = ",".join(f"'{name}'" for name in reads)
    lacking = ",".join(f"'{name}'" for name in missing)
    return (
        f"[request id: {context.request_id or '<id_unknown>'}] {expected} but got "
        f"{len(reads)} inputs for model '{model.name}'. Got input(s) [{got}], but missing "
        f"required input(s) [{lacking}]. Please provide all required input(s)."
    )


def load_ensemble_backend(
    config: ModelConfig,
    model_path: Path,
    placement: Placement,
    config_name: str = "",
    default_max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
) -> EnsembleBackend:
    if not config.ensemble_steps:
        raise InvalidConfig(f"ensemble '{config.name}' has no steps")
    return EnsembleBackend(config, model_path, placement, config_name, default_max_batch_size)
