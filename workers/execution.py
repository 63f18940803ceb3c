"""Execution: running one batch on the backend and answering its requests.

A batch's requests whose deadline passed (or, with adaptive batching, would pass before
the batch computes) are answered without computing; the rest are combined along the batch
dimension, computed on a compute thread (or on the event loop itself, when the backend
allows it and the batch should take under :data:`INLINE_MAX_S`: handing a tiny model's
batch to a thread and back costs more CPU than computing it), split again and answered.
Answers are published, and entries acknowledged, in one pipelined round trip per batch
(:mod:`sluice.workers.replies`) while the next batch computes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, cast

from sluice.core.clock import CLOCK
from sluice.core.config import ModelConfig
from sluice.core.errors import DeadlineExceeded, InferenceFailed, InvalidInput, SluiceError
from sluice.core.request_parameters import model_parameters
from sluice.core.sequences import ensemble_response_parameters, request_sequence
from sluice.core.wire import ReplyMessage, RequestMessage
from sluice.workers.adaptive import BatchPolicy
from sluice.workers.backends.base import (
    Backend,
    CancelSignal,
    ConcurrentBackend,
    FollowsCancellation,
    ReadsParameters,
    RequestContext,
    RequestsFailed,
    SequenceFlags,
    absent_outputs,
)
from sluice.workers.decoupled import Answer, SendPartial, compute_streaming
from sluice.workers.replies import (
    BatchClose,
    Outcome,
    Publisher,
    Timing,
    error_outcome,
    log_failures,
)
from sluice.workers.response_stats import ResponseTally
from sluice.workers.sequence_book import SequenceBook
from sluice.workers.serving import serving
from sluice.workers.slots import ComputeGate
from sluice.workers.tensors import PendingRequest, combine, output_names, split

if TYPE_CHECKING:
    from sluice.core.observability.otel import BatchSpan, Tracing
    from sluice.workers.cancellations import CancelWatch
    from sluice.workers.rate_limiter import RateLimiter

log = logging.getLogger(__name__)

INLINE_MAX_S = 0.0005
"""A batch the cost model expects to keep the instance busy for less than this computes on
the event loop instead of a compute thread, when the backend allows it
(``computes_inline``): each hand-off to a thread and back wakes two threads, which on a
virtual machine costs about as much CPU as a small model's whole run, while the loop is
held for well under a millisecond."""


class Execution:
    """Computes batches of one model version on ``backend`` and publishes their answers."""

    def __init__(
        self,
        config: ModelConfig,
        version: int,
        *,
        backend: Backend | None = None,
        publisher: Publisher | None = None,
        executor: ThreadPoolExecutor | None = None,
        policy: BatchPolicy | None = None,
        labels: dict[str, list[bytes]] | None = None,
        book: SequenceBook | None = None,
        concurrency: int = 1,
        tracing: Tracing | None = None,
        send_partial: SendPartial | None = None,
        cancels: CancelWatch | None = None,
        limiter: RateLimiter | None = None,
    ) -> None:
        """``labels``: each output's classification labels. ``book``: a sequence model's
        sequences. ``concurrency``: batches the backend computes at once. ``tracing``: record
        each batch's spans. ``send_partial``: a decoupled model's partial responses.
        ``cancels``: requests whose callers went away, dropped before they compute.
        ``limiter``: the rate limiter's resources, held while a batch computes.
        (:meth:`compute` alone needs only the config and version.)"""
        self.config = config
        self.version = version
        self._backend = backend
        self._publisher = publisher
        self._executor = executor
        self.policy = policy or BatchPolicy(0.0, False)
        self.labels = labels or {}
        self.book = book
        self.concurrency = concurrency
        self.tracing = tracing
        self.send_partial = send_partial
        self.cancels = cancels
        self.limiter = limiter
        self._computes_inline = bool(getattr(backend, "computes_inline", False))
        self._publish_turn = asyncio.Lock()
        """Held while a batch's answers are published (one batch's at a time)."""

    @property
    def backend(self) -> Backend:
        assert self._backend is not None
        return self._backend

    @property
    def publisher(self) -> Publisher:
        assert self._publisher is not None
        return self._publisher

    async def execute(
        self, batch: list[PendingRequest], close: BatchClose, gate: ComputeGate
    ) -> None:
        """Compute ``batch``, then publish its answers while the next batch computes: the
        instance is free (``gate``) again once this batch's answers are the next to go, so
        at most one batch's answers are in flight and a Redis round trip is not on the
        path from one batch to the next. (With a concurrent backend, ``gate`` counts free
        slots: this batch gives its slot back at the same point.)"""
        started = time.monotonic()
        policy = self.policy
        turn = False
        try:
            if self.limiter is None:
                outcomes, timing, items = await self._compute_batch(batch)
            else:
                # (Waiting for the resources counts as the requests' queue time.)
                async with self.limiter.holding():
                    outcomes, timing, items = await self._compute_batch(batch)
            await self._publish_turn.acquire()
            turn = True
        finally:
            busy_s = time.monotonic() - started
            gate.set()
        try:
            if items:
                # What the batch cost: the instance was busy for this long.
                predicted = policy.cost.predict(items) if policy.cost.warm else None
                if predicted is not None and busy_s > 0:
                    close.cost_error = abs(predicted - busy_s) / busy_s
                policy.cost.observe(items, busy_s)
            log_failures(outcomes)
            await self.publisher.publish(outcomes, timing, items, close)
        finally:
            if turn:
                self._publish_turn.release()

    async def _compute_batch(
        self, batch: list[PendingRequest]
    ) -> tuple[list[Outcome], Timing, int]:
        """Each request's outcome, the batch's timing and the items computed. Requests
        whose deadline passed, or (adaptive batching) cannot be met by the batch's
        expected cost, are answered without computing."""
        now_ns = CLOCK.now_ns()
        policy = self.policy
        cost = policy.cost
        predicted_s = cost.predict(sum(r.items for r in batch)) if cost.warm else 0.0
        doomed_ns = now_ns + int(predicted_s * 1e9) if policy.adaptive else now_ns
        if log.isEnabledFor(logging.DEBUG):
            ids = [r.message.request_id for r in batch]
            log.debug("batch of %d request(s)", len(batch), extra={"request_ids": ids})
        span = self._trace_batch(batch, now_ns) if self.tracing is not None else None
        failure = ""
        outcomes: list[Outcome] = []
        live: list[PendingRequest] = []
        dropped: list[PendingRequest] = []
        cancels = self.cancels
        for request in batch:
            deadline = request.message.deadline_ns
            if cancels is not None and cancels.cancelled(request.message):
                dropped.append(request)
            elif deadline and deadline < now_ns:
                expired = DeadlineExceeded("the request's deadline passed while it was queued")
                outcomes.append(error_outcome(request, self.version, expired))
            elif deadline and deadline < doomed_ns:
                doomed = DeadlineExceeded(
                    "the request's deadline would pass before its batch computes "
                    f"(about {predicted_s * 1e3:.3g} ms)"
                )
                outcomes.append(error_outcome(request, self.version, doomed))
            else:
                live.append(request)
        if dropped:
            await self.publisher.drop(dropped)
        if self.book is not None and live:
            live, refused = await self.book.admit(live)
            outcomes += [error_outcome(r, self.version, exc) for r, exc in refused]
        parameters: dict[bytes, dict[str, bool | int | str]] = {}
        if self.config.is_ensemble and live:
            live = self._response_parameters(live, parameters, outcomes)
        timing = Timing(started_ns=now_ns)
        if live:
            await self.publisher.started(live)
            loop = asyncio.get_running_loop()
            signals, forget = self._watch(live)
            try:
                if self._inline(live):
                    results = self.compute(live, self.backend, timing, signals)
                else:
                    results = await loop.run_in_executor(
                        self._executor, self.compute, live, self.backend, timing, signals
                    )
                for request, result in zip(live, results, strict=True):
                    if isinstance(result, SluiceError):
                        outcomes.append(error_outcome(request, self.version, result))
                        continue
                    headers, payload = result
                    reply = ReplyMessage(
                        request.message.request_key,
                        self.version,
                        headers,
                        parameters=parameters.get(request.entry_id)
                        or timing.response_parameters.get(request.entry_id, {}),
                    )
                    outcomes.append(Outcome(request, reply, payload))
            except Exception as exc:
                error: SluiceError = (
                    exc
                    if isinstance(exc, SluiceError)
                    else InferenceFailed(f"{type(exc).__name__}: {exc}")
                )
                failure = error.message
                outcomes.extend(error_outcome(r, self.version, error) for r in live)
            finally:
                for undo in forget:
                    undo()
        if span is not None:
            span.end(failure)
        return outcomes, timing, sum(r.items for r in live)

    def _inline(self, live: list[PendingRequest]) -> bool:
        """Whether ``live`` computes on the event loop (:data:`INLINE_MAX_S`): one batch at
        a time, not a decoupled model's, on a backend that declares ``computes_inline``
        (it never calls back into this loop), expected to be short."""
        if self.concurrency != 1 or self.config.decoupled or not self._computes_inline:
            return False
        cost = self.policy.cost
        return cost.warm and cost.predict(sum(r.items for r in live)) < INLINE_MAX_S

    def _response_parameters(
        self,
        live: list[PendingRequest],
        parameters: dict[bytes, dict[str, bool | int | str]],
        outcomes: list[Outcome],
    ) -> list[PendingRequest]:
        """An ensemble's requests: the sequence parameters each answer carries, as Triton's
        ensemble responses do, into ``parameters``; a request whose sequence parameters are
        of the wrong type is refused (``outcomes``) before it computes."""
        kept: list[PendingRequest] = []
        for request in live:
            try:
                found = ensemble_response_parameters(request.message.parameters)
            except InvalidInput as exc:
                outcomes.append(error_outcome(request, self.version, exc))
                continue
            parameters[request.entry_id] = found
            kept.append(request)
        return kept

    def _watch(
        self, live: list[PendingRequest]
    ) -> tuple[list[CancelSignal] | None, list[Callable[[], None]]]:
        """For a backend that makes requests on its requests' behalf (an ensemble, a Python
        model's BLS calls) or asks whether they are cancelled, and for a decoupled model
        (whose stream ends when its caller goes away): a signal per request, set if its
        caller goes away while it computes, and what forgets them afterwards."""
        if self.cancels is None or not (
            self.concurrency > 1
            or self.config.decoupled
            or getattr(self._backend, "follows_cancellation", False)
        ):
            return None, []
        signals = [CancelSignal() for _ in live]
        forget = [
            self.cancels.on_cancel(request.message, signal.set)
            for request, signal in zip(live, signals, strict=True)
        ]
        return signals, forget

    def _trace_batch(self, batch: list[PendingRequest], started_ns: int) -> BatchSpan:
        """Each request's ``queue_wait`` span, and the batch's ``batch_compute`` span."""
        assert self.tracing is not None
        requests = [(r.message.trace, r.message.request_id, r.message.enqueued_ns) for r in batch]
        return self.tracing.batch(self.config.name, self.version, requests, started_ns)

    # -- on a compute thread ---------------------------------------------------------------

    def compute(
        self,
        batch: list[PendingRequest],
        backend: Backend,
        timing: Timing,
        signals: list[CancelSignal] | None = None,
    ) -> list[Answer]:
        """Each request's (output headers, payload), or its own error. ``signals``: each
        request's cancellation, for a concurrent backend."""
        t0 = time.perf_counter_ns()
        try:
            inputs = combine(batch, self.config)
        except InvalidInput:
            if len(batch) == 1:
                raise
            return self._each_alone(batch, backend, timing)
        if self.config.decoupled:
            assert self.send_partial is not None
            answers = compute_streaming(
                batch,
                inputs,
                backend,
                self.config,
                self.version,
                self.labels,
                self.send_partial,
                signals,
                [_sequence_flags(r.message) for r in batch],
                self._contexts(batch, signals) if self.concurrency > 1 else None,
                ResponseTally(timing.responses),
                timing.response_parameters,
                # (Every response of an ensemble carries its request's sequence parameters,
                # as Triton's do: the partial ones of a decoupled ensemble too.)
                [ensemble_response_parameters(r.message.parameters) for r in batch]
                if self.config.is_ensemble
                else None,
            )
            timing.infer_ns = time.perf_counter_ns() - t0
            return answers
        book = self.book
        wanted = output_names(batch)
        if book is not None:
            try:
                inputs.update(book.inputs(batch))
            except InvalidInput:
                if len(batch) == 1:
                    raise
                return self._each_alone(batch, backend, timing)
            wanted = list(dict.fromkeys([*wanted, *book.state_outputs]))
        t1 = time.perf_counter_ns()
        failures: dict[int, SluiceError] = {}
        try:
            if self.concurrency == 1 and getattr(backend, "follows_cancellation", False):
                # A Triton-style Python model: each request's cancellation, correlation id
                # and flags (``request.is_cancelled()``, ``correlation_id()``, ``flags()``).
                replied: list[dict[str, Any]] = []
                try:
                    outputs = cast(FollowsCancellation, backend).infer(
                        inputs,
                        wanted,
                        request_sizes=[r.items for r in batch],
                        cancellations=signals,
                        sequences=[_sequence_flags(r.message) for r in batch],
                        parameters=[model_parameters(r.message.parameters) for r in batch],
                        response_parameters=replied,
                        tenants=[r.message.tenant for r in batch],
                    )
                finally:
                    for request, own in zip(batch, replied, strict=False):
                        if own:
                            timing.response_parameters[request.entry_id] = own
            elif self.concurrency == 1 and getattr(backend, "reads_parameters", False):
                # A TorchServe handler: each request's mark from its route (an explanation),
                # and the status the handler gave its answer.
                statuses: list[dict[str, Any]] = []
                try:
                    outputs = cast(ReadsParameters, backend).infer(
                        inputs,
                        wanted,
                        request_sizes=[r.items for r in batch],
                        parameters=[r.message.parameters for r in batch],
                        response_parameters=statuses,
                    )
                finally:
                    for request, own in zip(batch, statuses, strict=False):
                        if own:
                            timing.response_parameters[request.entry_id] = own
            elif self.concurrency == 1:
                # (A Python model's calls made meanwhile are its requests' tenant's.)
                with serving(r.message.tenant for r in batch):
                    outputs = backend.infer(inputs, wanted, request_sizes=[r.items for r in batch])
            else:
                # A concurrent backend (an ensemble) passes each request's deadline and ids
                # on to the requests it makes itself.
                outputs = cast(ConcurrentBackend, backend).infer(
                    inputs,
                    wanted,
                    request_sizes=[r.items for r in batch],
                    contexts=self._contexts(batch, signals),
                )
        except RequestsFailed as exc:
            if exc.outputs is None or book is not None:
                return [exc.failures.get(i, exc) for i in range(len(batch))]
            outputs, failures = exc.outputs, dict(exc.failures)
        if book is not None:
            book.update(batch, outputs)
        t2 = time.perf_counter_ns()
        try:
            results = split(batch, outputs, self.config, self.labels, absent_outputs(outputs))
        except InvalidInput:
            if len(batch) == 1:
                raise
            return self._each_alone(batch, backend, timing)
        t3 = time.perf_counter_ns()
        timing.input_ns, timing.infer_ns, timing.output_ns = t1 - t0, t2 - t1, t3 - t2
        return [failures.get(i, result) for i, result in enumerate(results)]

    @staticmethod
    def _contexts(
        batch: list[PendingRequest], signals: list[CancelSignal] | None
    ) -> list[RequestContext]:
        """What a concurrent backend passes on to the requests it makes for ``batch``."""
        return [
            _context(r.message, signals[i] if signals is not None else None)
            for i, r in enumerate(batch)
        ]

    def _each_alone(
        self, batch: list[PendingRequest], backend: Backend, timing: Timing
    ) -> list[Answer]:
        """One request's bad input (a client region gone, shrunk or replaced by a link
        since :func:`validate`, or a shape a batch input's type cannot hold) fails that
        request only: the batch runs request by request."""
        results: list[Answer] = []
        for request in batch:
            try:
                results.extend(self.compute([request], backend, timing))
            except SluiceError as exc:
                results.append(exc)
        return results


def _sequence_flags(message: RequestMessage) -> SequenceFlags:
    """The request's correlation id and flags (0 and 0 where its sequence parameters are
    absent, or of the wrong type on a model that is no sequence model: such a model ignores
    them, as it did before)."""
    try:
        return request_sequence(message.parameters)
    except InvalidInput:
        return 0, 0


def _context(message: RequestMessage, cancelled: CancelSignal | None) -> RequestContext:
    return RequestContext(
        request_id=message.request_id or message.client_id,
        deadline_ns=message.deadline_ns,
        trace=message.trace,
        priority=message.priority,
        cancelled=cancelled,
        outputs=tuple(message.outputs),
        sequence=_sequence_flags(message),
        parameters=model_parameters(message.parameters),
        tenant=message.tenant,
    )
