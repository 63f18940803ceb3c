"""Decoupled streaming: a model that sends any number of responses per request.

Each response but a request's final one is published as it comes, from the compute thread
(in order: the thread waits for each), with its index among the request's responses; the
final ones are returned, and published and acknowledged as any answer. A request whose
worker died mid-stream is delivered again and computed from the start: the gateway skips
the responses whose index it has forwarded already (:meth:`sluice.core.dispatch.
RedisDispatcher.submit_stream`), so the client sees each once. Python models and
ensembles can be decoupled (``infer_stream``; an ensemble is, exactly when one of its
composing models is).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from sluice.core.config import ModelConfig
from sluice.core.errors import Cancelled, InferenceFailed, InvalidConfig, SluiceError
from sluice.core.request_parameters import model_parameters
from sluice.core.wire import ReplyMessage, TensorHeader
from sluice.workers.backends.base import Backend, CancelSignal, RequestContext, SequenceFlags
from sluice.workers.replies import Publisher
from sluice.workers.response_stats import RequestClock, ResponseTally
from sluice.workers.serving import serving
from sluice.workers.tensors import PendingRequest, output_names, split

Answer = tuple[list[TensorHeader], bytes] | SluiceError
"""One request's (output headers, payload), or its own error."""

SendPartial = Callable[[PendingRequest, ReplyMessage, bytes], None]
"""Publishes one non-final response and returns once it is sent (called off the loop)."""


def check_streams(config: ModelConfig, backend: Backend) -> None:
    """A decoupled model's backend must be able to stream (checked as the model loads)."""
    if config.decoupled and not hasattr(backend, "infer_stream"):
        raise InvalidConfig(
            f"model '{config.name}' is decoupled (model_transaction_policy), which "
            "only Python models and ensembles can be"
        )


def partial_sender(publisher: Publisher, loop: asyncio.AbstractEventLoop) -> SendPartial:
    """Sends partial responses on the worker's event loop, from the compute thread."""

    def send(request: PendingRequest, reply: ReplyMessage, payload: bytes) -> None:
        partial = publisher.partial(request, reply, payload)
        asyncio.run_coroutine_threadsafe(partial, loop).result()

    return send


def compute_streaming(
    batch: list[PendingRequest],
    inputs: dict[str, Any],
    backend: Backend,
    config: ModelConfig,
    version: int,
    labels: dict[str, list[bytes]],
    send_partial: SendPartial,
    cancellations: list[CancelSignal] | None = None,
    sequences: list[SequenceFlags] | None = None,
    contexts: list[RequestContext] | None = None,
    tally: ResponseTally | None = None,
    response_parameters: dict[bytes, dict[str, Any]] | None = None,
    every_response: list[dict[str, Any]] | None = None,
) -> list[Answer]:
    """A decoupled model's batch: each request's final answer (its partial ones are sent
    as they come). A request whose final response carries no outputs is answered with none
    (clients see the stream end). A backend that follows cancellation (a Triton-style
    Python model) also gets each request's cancellation and sequence flags; a concurrent
    one (a decoupled ensemble) each request's ``contexts``. A model in Sluice's own API is
    stopped at its next response once its request is cancelled: its generator is closed,
    and the request ends as cancelled. ``tally`` counts each response
    (Triton's ``response_stats``); ``response_parameters`` gets the parameters of each
    request's final response (by entry id; its other responses carry theirs).
    ``every_response``: parameters each request's partial responses carry as well (a
    decoupled ensemble's sequence parameters, which Triton puts on each of its responses;
    the final one gets them from its caller)."""
    finals: dict[int, Answer] = {}
    sent = [0] * len(batch)
    """Each request's partial responses so far: the next one's index."""
    clocks = [RequestClock() for _ in batch]

    def emit(index: int, outputs: Any, final: bool) -> None:
        made_at = time.perf_counter_ns()
        request = batch[index]
        result: Answer
        if outputs is None:
            result = ([], b"")
        elif isinstance(outputs, SluiceError):
            result, final = outputs, True
        else:
            try:
                result = split([request], outputs, config, labels)[0]
            except SluiceError as exc:
                result, final = exc, True
        if index in finals:
            return  # the request was answered already
        carried: dict[str, Any] = getattr(outputs, "parameters", None) or {}
        if final:
            finals[index] = result
            if carried and response_parameters is not None:
                response_parameters[request.entry_id] = carried
            if tally is not None:
                tally.add(sent[index], _outcome(result, outputs), *clocks[index].lap(made_at))
            return
        assert not isinstance(result, SluiceError)
        headers, payload = result
        at = sent[index]
        if every_response is not None:
            carried = {**every_response[index], **carried}
        reply = ReplyMessage(
            request.message.request_key,
            version,
            headers,
            final=False,
            index=at,
            parameters=carried,
        )
        sent[index] += 1
        send_partial(request, reply, payload)
        if tally is not None:
            tally.add(at, "success", *clocks[index].lap(made_at))

    stream = getattr(backend, "infer_stream")  # noqa: B009 (checked when the model loaded)
    sizes = [r.items for r in batch]
    if contexts is not None:
        stream(inputs, output_names(batch), sizes, emit, contexts=contexts)
    elif getattr(backend, "follows_cancellation", False):
        own = [model_parameters(r.message.parameters) for r in batch]
        tenants = [r.message.tenant for r in batch]
        stream(inputs, output_names(batch), sizes, emit, cancellations, sequences, own, tenants)
    else:

        def emit_unless_cancelled(index: int, outputs: Any, final: bool) -> None:
            if not final and cancellations is not None and cancellations[index].is_set():
                # (Raised into the backend's loop over the model's generator, which ends the
                # request with it: a generator without end would hold the instance for good.)
                raise Cancelled("the request was cancelled while its model streamed")
            emit(index, outputs, final)

        with serving(r.message.tenant for r in batch):
            stream(inputs, output_names(batch), sizes, emit_unless_cancelled)
    missing = InferenceFailed("the model sent no final response")
    return [finals.get(index, missing) for index in range(len(batch))]


def _outcome(result: Answer, outputs: Any) -> str:
    """How a request's final response ended, in Triton's ``response_stats`` terms."""
    if isinstance(result, Cancelled):
        return "cancel"
    if isinstance(result, SluiceError):
        return "fail"
    return "empty_response" if outputs is None else "success"
