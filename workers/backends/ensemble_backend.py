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
Each step additionally has at most :data:`STEP_IN_FLIGHT` requests in flight, so that one
slow composing model cannot collect an unbounded queue from one ensemble instance.

A failing step fails the request with the step's error class (so the same HTTP status and
gRPC code) and a message naming the ensemble, the step and its model.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from concurrent.futures import CancelledError
from pathlib import Path
from typing import Any

import numpy as np

from sluice.core.config import ModelConfig
from sluice.core.errors import (
    Cancelled,
    InferenceFailed,
    InvalidConfig,
    SluiceError,
)
from sluice.core.placement import Placement
from sluice.workers.backends.base import RequestContext, RequestsFailed
from sluice.workers.backends.ensemble_check import composing_configs
from sluice.workers.backends.ensemble_join import join_requests, split_requests
from sluice.workers.model_calls import CallContext, ModelCalls

log = logging.getLogger(__name__)

CONCURRENCY = 64
"""Batches one ensemble instance runs at once. An instance holds nothing per request but
its tensors, and waits on other models: 64 keeps a few instances' worth of composing
models busy (as Triton's ensemble scheduler keeps every request in flight) while bounding
the threads and the memory of one worker process."""

STEP_IN_FLIGHT = 64
"""Requests one instance has queued on one step's model at once (the same bound)."""


class EnsembleBackend:
    concurrency = CONCURRENCY

    def __init__(self, config: ModelConfig, model_path: Path, placement: Placement) -> None:
        """``model_path`` is the version folder (``<repository>/<ensemble>/<version>``)."""
        del placement  # an ensemble computes nothing itself
        self.config = config
        self.steps = config.ensemble_steps
        self.step_configs = composing_configs(config, model_path.parent.parent)
        self._limits = [asyncio.Semaphore(STEP_IN_FLIGHT) for _ in self.steps]
        self._calls = ModelCalls(f"ensemble-{config.name}-")

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
        parts = split_requests(inputs, sizes, self.config.max_batch_size > 0)
        if contexts is None or len(contexts) != len(parts):
            contexts = [RequestContext("", 0, None)] * len(parts)
        futures = [
            asyncio.run_coroutine_threadsafe(self.run(part, outputs, context), self._calls.loop)
            for part, context in zip(parts, contexts, strict=True)
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

    # -- one request -----------------------------------------------------------------------

    async def run(
        self, inputs: Mapping[str, np.ndarray], outputs: Sequence[str], context: RequestContext
    ) -> dict[str, np.ndarray]:
        """The requested ensemble outputs of one request."""
        loop = asyncio.get_running_loop()
        tensors: dict[str, asyncio.Future[np.ndarray]] = {}

        def slot(name: str) -> asyncio.Future[np.ndarray]:
            if name not in tensors:
                tensors[name] = loop.create_future()
            return tensors[name]

        for name, array in inputs.items():
            slot(name).set_result(array)
        tasks = [
            asyncio.create_task(self._step(index, slot, context))
            for index in range(len(self.steps))
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
            return {name: future.result() for name, future in zip(outputs, wanted, strict=True)}
        finally:
            for task in tasks:
                task.cancel()
            for future in tensors.values():
                if not future.done():
                    future.cancel()

    async def _step(self, index: int, slot: Any, context: RequestContext) -> None:
        step = self.steps[index]
        reads = {name: await slot(tensor) for name, tensor in step.input_map.items()}
        try:
            async with self._limits[index]:
                answer = await self._submit(index, reads, context)
        except SluiceError as exc:
            prefix = f"in ensemble '{self.config.name}', step {index} (model '{step.model_name}')"
            raise type(exc)(f"{prefix}: {exc.message}") from None
        for name, tensor in step.output_map.items():
            if name not in answer:
                raise InferenceFailed(
                    f"in ensemble '{self.config.name}', step {index} (model "
                    f"'{step.model_name}'): the model did not answer output '{name}'"
                )
            slot(tensor).set_result(answer[name])

    async def _submit(
        self, index: int, reads: dict[str, np.ndarray], context: RequestContext
    ) -> dict[str, np.ndarray]:
        step, model = self.steps[index], self.step_configs[index]
        inputs = []
        for name, array in reads.items():
            spec = model.input(name)
            assert spec is not None  # checked when the ensemble loaded
            inputs.append((name, spec.datatype, array))
        call = CallContext(context.request_id, context.deadline_ns, context.trace)
        return await self._calls.submit(
            step.model_name, step.model_version, inputs, list(step.output_map), call
        )


def load_ensemble_backend(
    config: ModelConfig, model_path: Path, placement: Placement
) -> EnsembleBackend:
    if not config.ensemble_steps:
        raise InvalidConfig(f"ensemble '{config.name}' has no steps")
    return EnsembleBackend(config, model_path, placement)
