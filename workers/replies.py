"""Publishing a batch's answers: reply entries, acknowledgement, deletion and statistics,
all in one pipelined round trip. An entry is acknowledged only with its answer."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.client import Pipeline
from redis.exceptions import RedisError

from sluice.core import jobs
from sluice.core.clock import CLOCK
from sluice.core.errors import Cancelled, DeadlineExceeded, SluiceError, error_kind
from sluice.core.keys import WORKER_GROUP, Keys
from sluice.core.observability import histograms as hist
from sluice.core.observability import statistics as st
from sluice.core.wire import ReplyMessage, RequestMessage, encode_replies, encode_reply
from sluice.workers.slot_lease import SlotLease, SlotLost
from sluice.workers.tensors import PendingRequest

log = logging.getLogger(__name__)

_ATTEMPTS = 5


@dataclass(slots=True)
class Outcome:
    request: PendingRequest
    reply: ReplyMessage
    payload: bytes = b""


@dataclass(slots=True)
class Timing:
    started_ns: int = 0
    input_ns: int = 0
    infer_ns: int = 0
    output_ns: int = 0
    responses: dict[str, int] = field(default_factory=dict)
    """A decoupled model's responses (:class:`sluice.workers.response_stats.ResponseTally`)."""
    response_parameters: dict[bytes, dict[str, Any]] = field(default_factory=dict)
    """The parameters a model put on each request's response (by entry id)."""


@dataclass(slots=True)
class BatchClose:
    """How a batch was formed (see :mod:`sluice.workers.adaptive`), for the metrics."""

    reason: str
    """One of :data:`sluice.core.observability.statistics.BATCH_CLOSE_REASONS`."""
    opened: float
    """When the batch's first request was held (monotonic seconds)."""
    waited_ns: int = 0
    """From then until the batch went to compute."""
    cost_error: float | None = None
    """How far the cost model missed this batch's cost (relative), once it is known."""


def error_outcome(request: PendingRequest, version: int, error: SluiceError) -> Outcome:
    reply = ReplyMessage(
        request.message.request_key, version, error_kind=error_kind(error), error=error.message
    )
    return Outcome(request, reply)


def log_failures(outcomes: list[Outcome]) -> None:
    """One line per failed request, with its ids and the error's text (never its data);
    a deadline that passed in the queue is routine under load, so only INFO."""
    for outcome in outcomes:
        reply = outcome.reply
        if reply.error_kind:
            level = (
                logging.INFO if reply.error_kind == DeadlineExceeded.__name__ else logging.WARNING
            )
            log.log(
                level,
                "request failed: %s: %s",
                reply.error_kind,
                reply.error,
                extra=_log_ids(outcome.request.message),
            )


def _log_ids(message: RequestMessage) -> dict[str, Any]:
    """The ids a request's log lines carry (see :mod:`sluice.core.observability.logs`)."""
    trace_id = message.trace.trace_id if message.trace is not None else None
    return {"request_id": message.request_id or message.client_id or None, "trace_id": trace_id}


@dataclass
class Publisher:
    redis: Redis
    keys: Keys
    model: str
    version: int
    worker_id: str
    reply_max_len: int
    histograms: bool = True
    """Keep the latency and batch-size histograms (off with SLUICE_ALLOW_METRICS=false)."""
    checkpoints: Callable[[Pipeline, list[PendingRequest]], None] | None = None
    """A sequence model's: queues each answered request's checkpoint; answers, checkpoints
    and acknowledgements then go in one transaction."""
    published: Callable[[list[PendingRequest]], None] | None = None
    """Told which requests' answers went out (their checkpoints are then forgotten)."""
    lease: SlotLease | None = None
    """A sequence worker's slot lease: its checkpoints are written only while it holds it."""

    async def publish(
        self,
        outcomes: list[Outcome],
        timing: Timing | None = None,
        items: int = 0,
        close: BatchClose | None = None,
    ) -> bool:
        """True once published; False after retries failed (the entries stay pending and are
        delivered again elsewhere)."""
        if not outcomes:
            return True
        by_stream: dict[str, list[bytes]] = defaultdict(list)
        for outcome in outcomes:
            by_stream[outcome.request.stream].append(outcome.request.entry_id)
        for attempt in range(_ATTEMPTS):
            try:
                if self.checkpoints is None:
                    async with self.redis.pipeline(transaction=False) as pipe:
                        self._send(pipe, outcomes)
                        self._settle(pipe, outcomes, by_stream, timing, items, close)
                        await pipe.execute()
                else:
                    # A sequence model: its checkpoints, acknowledgements and statistics
                    # live in the model's slot and go in one transaction; the answers go to
                    # the gateways' slots first. Lost in between, the request is computed
                    # again from the same checkpoint and its second answer is dropped.
                    async with self.redis.pipeline(transaction=False) as pipe:
                        self._send(pipe, outcomes)
                        await pipe.execute()
                    async with self.redis.pipeline(transaction=True) as pipe:
                        if self.lease is not None:
                            await self.lease.fence(pipe)
                        self.checkpoints(pipe, [outcome.request for outcome in outcomes])
                        self._settle(pipe, outcomes, by_stream, timing, items, close)
                        await pipe.execute()
                if self.published is not None:
                    self.published([outcome.request for outcome in outcomes])
                return True
            except SlotLost:
                log.error("not recording %d answers: %s", len(outcomes), "the slot was taken")
                return False  # the worker that took the slot computes them again
            except RedisError as exc:
                log.warning(
                    "publishing %d answers failed (try %d): %s", len(outcomes), attempt + 1, exc
                )
                await asyncio.sleep(0.2 * 2**attempt)
        log.error("gave up publishing %d answers; they stay pending for redelivery", len(outcomes))
        return False

    async def drop(self, requests: list[PendingRequest]) -> None:
        """Requests whose callers went away (:mod:`sluice.core.cancellation`), not computed:
        a job's record is settled as cancelled; any other entry is only acknowledged and
        deleted, as its caller's gateway counted the cancellation already."""
        job_requests: list[PendingRequest] = []
        others: list[PendingRequest] = []
        for request in requests:
            reply_to = request.message.reply_to
            (job_requests if reply_to and self.keys.is_job(reply_to) else others).append(request)
        if job_requests:
            cancelled = Cancelled("the job was cancelled before it was computed")
            await self.publish([error_outcome(r, self.version, cancelled) for r in job_requests])
        if not others:
            return
        by_stream: dict[str, list[bytes]] = defaultdict(list)
        for request in others:
            by_stream[request.stream].append(request.entry_id)
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                for stream, ids in by_stream.items():
                    pipe.xack(stream, WORKER_GROUP, *ids)
                    pipe.xdel(stream, *ids)
                await pipe.execute()
        except RedisError as exc:  # delivered again later, and dropped again then
            log.warning("acknowledging %d cancelled requests failed: %s", len(others), exc)

    def _send(self, pipe: Pipeline, outcomes: list[Outcome]) -> None:
        """Queue the answers to the gateways waiting for them: one entry per reader for the
        answers of readers that take them together, one per answer for the others."""
        together: dict[str, list[tuple[ReplyMessage, bytes]]] = {}
        for outcome in outcomes:
            message = outcome.request.message
            reply_to = message.reply_to
            if not reply_to or self.keys.is_job(reply_to):
                continue
            if message.replies_together:
                together.setdefault(reply_to, []).append((outcome.reply, outcome.payload))
                continue
            self._add(pipe, reply_to, encode_reply(outcome.reply, outcome.payload))
        for reply_to, replies in together.items():
            self._add(pipe, reply_to, encode_replies(replies))

    def _add(self, pipe: Pipeline, reply_to: str, fields: dict[bytes, bytes]) -> None:
        pipe.xadd(
            reply_to,
            fields,  # type: ignore[arg-type]
            maxlen=self.reply_max_len,
            approximate=True,
        )

    def _settle(
        self,
        pipe: Pipeline,
        outcomes: list[Outcome],
        by_stream: dict[str, list[bytes]],
        timing: Timing | None,
        items: int,
        close: BatchClose | None,
    ) -> None:
        """Queue what stays in the model's slot: jobs' answers, acknowledgements, statistics."""
        for outcome in outcomes:
            reply_to = outcome.request.message.reply_to
            if reply_to and self.keys.is_job(reply_to):
                self._finish_job(pipe, reply_to, outcome)
        for stream, ids in by_stream.items():
            pipe.xack(stream, WORKER_GROUP, *ids)
            pipe.xdel(stream, *ids)
        self._record(pipe, outcomes, timing, items, close)

    async def partial(self, request: PendingRequest, reply: ReplyMessage, payload: bytes) -> None:
        """One response of a decoupled model that is not its last for ``request``: sent, not
        acknowledged (the final one is). One that cannot be sent (Redis away) is logged and
        skipped: the client sees the responses that were sent, then the final one."""
        reply_to = request.message.reply_to
        if not reply_to or self.keys.is_job(reply_to):
            return
        try:
            await self.redis.xadd(
                reply_to,
                encode_reply(reply, payload),  # type: ignore[arg-type]
                maxlen=self.reply_max_len,
                approximate=True,
            )
        except RedisError as exc:
            log.warning("sending a response of a decoupled model failed: %s", exc)

    def _finish_job(self, pipe: Pipeline, job: str, outcome: Outcome) -> None:
        """The answer goes into the job's record (unless it was cancelled meanwhile, or
        answered already: a request delivered twice)."""
        keys, args = jobs.finish_call(
            self.keys, self.model, self.version, job, outcome.reply, outcome.payload
        )
        pipe.eval(jobs.FINISH, len(keys), *keys, *args)

    async def started(self, requests: list[PendingRequest]) -> None:
        """Mark the jobs among ``requests`` in progress, and give back the room they held
        in their tenants' queued-job accounts (best effort: their answer gives it back too)."""
        started = [r.message for r in requests if self.keys.is_job(r.message.reply_to)]
        if not started:
            return
        keys = [self.keys.queued_jobs(self.model), self.keys.job_room(self.model)]
        keys += [m.reply_to for m in started]
        ids = [m.request_key for m in started]
        try:
            await self.redis.eval(jobs.START, len(keys), *keys, f"{time.time():.6f}", *ids)
        except RedisError as exc:
            log.debug("marking %d job(s) in progress failed: %s", len(started), exc)

    def _record(
        self,
        pipe: Pipeline,
        outcomes: list[Outcome],
        timing: Timing | None,
        items: int,
        close: BatchClose | None = None,
    ) -> None:
        now_ns = CLOCK.now_ns()
        ok = [o for o in outcomes if not o.reply.error_kind]
        counters: dict[str, int] = {}
        failed = len(outcomes) - len(ok)
        if failed:
            counters[st.count_field("fail")] = failed
            counters[st.ns_field("fail")] = sum(
                max(0, now_ns - o.request.message.enqueued_ns)
                for o in outcomes
                if o.reply.error_kind
            )
            for outcome in outcomes:
                kind = outcome.reply.error_kind
                if kind:
                    counter = st.failure_field(st.failure_reason(kind))
                    counters[counter] = counters.get(counter, 0) + 1
                    if kind == "DeadlineExceeded":
                        miss = st.deadline_miss_field("queue")
                        counters[miss] = counters.get(miss, 0) + 1
        if close is not None:
            self._record_close(counters, close)
        if timing is not None:
            for name, amount in timing.responses.items():
                counters[name] = counters.get(name, 0) + amount
        batch: dict[str, int] = {}
        instance: dict[str, int] = {}
        last_inference = None
        if ok and timing is not None:
            n = len(ok)
            durations = {
                "compute_input": timing.input_ns,
                "compute_infer": timing.infer_ns,
                "compute_output": timing.output_ns,
            }
            counters[st.INFERENCE_COUNT] = items
            counters[st.EXECUTION_COUNT] = 1
            counters[st.count_field("success")] = n
            # At least what this worker measured itself: enqueue times come from a gateway's
            # reading of the deployment's clock, which may differ from this one's by a round
            # trip, and a duration must never come out negative.
            held_ns = now_ns - timing.started_ns
            request_ns = [max(held_ns, now_ns - o.request.message.enqueued_ns) for o in ok]
            queue_ns = [max(0, timing.started_ns - o.request.message.enqueued_ns) for o in ok]
            counters[st.ns_field("success")] = sum(request_ns)
            counters[st.count_field("queue")] = n
            counters[st.ns_field("queue")] = sum(queue_ns)
            if self.histograms:
                hist.REQUEST.observe_all(counters, request_ns)
                hist.QUEUE.observe_all(counters, queue_ns)
                for outcome, waited_ns in zip(ok, queue_ns, strict=True):
                    if outcome.request.message.tenant:  # (named tenants: fair share's view)
                        hist.tenant_queue(outcome.request.message.tenant).observe(
                            counters, waited_ns
                        )
                compute_ns = timing.input_ns + timing.infer_ns + timing.output_ns
                hist.COMPUTE.observe(counters, compute_ns, n)
                hist.BATCH_SIZE.observe(counters, items)
            for kind, ns in durations.items():
                counters[st.count_field(kind)] = n
                counters[st.ns_field(kind)] = ns * n
                batch[st.batch_field(items, kind, "count")] = 1
                batch[st.batch_field(items, kind, "ns")] = ns
            instance[self.worker_id] = 1
            last_inference = now_ns // 1_000_000
        if not counters:
            return
        keys = [
            self.keys.stats(self.model, self.version),
            self.keys.batch_stats(self.model, self.version),
            self.keys.instance_stats(self.model, self.version),
        ]
        arguments = st.record_arguments([counters, batch, instance], last_inference)
        pipe.eval(st.RECORD_SCRIPT, len(keys), *keys, *arguments)

    def _record_close(self, counters: dict[str, int], close: BatchClose) -> None:
        """Why the batch closed, how long it waited, and how far the cost model missed."""
        counter = st.batch_close_field(close.reason)
        counters[counter] = counters.get(counter, 0) + 1
        if not self.histograms:
            return
        hist.BATCH_WAIT.observe(counters, close.waited_ns)
        if close.cost_error is not None:
            hist.COST_MODEL_ERROR.observe(counters, round(close.cost_error * hist.RATIO_UNIT))
