"""Models written for Triton's Python backend (``class TritonPythonModel``), run unchanged.

The worker hands over one combined batch; it is split back into one
``InferenceRequest`` per client request (``request_sizes``), ``execute`` answers
each with an ``InferenceResponse``, and the answers are joined again along the
batch dimension. As in Triton, requests whose ``allow_ragged_batch`` inputs differ in
shape share an ``execute`` call, each keeping its own tensors
(:class:`~sluice.workers.ragged.RaggedInputs`), and answers whose outputs differ in shape
stay each request's own (:class:`~sluice.workers.ragged.RaggedOutputs`).
A response carrying an error fails only its own request (:class:`RequestsFailed`); a
response without an output its request asked for answers without it, as Triton's does
(:class:`PartialOutputs`). Each request carries its correlation id and sequence flags
(``correlation_id()``, ``flags()``).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from sluice.core.config import ModelConfig
from sluice.core.errors import (
    InferenceFailed,
    InvalidConfig,
    InvalidInput,
    NotFound,
    SluiceError,
    Unavailable,
    Unsupported,
)
from sluice.core.placement import Placement
from sluice.workers import ragged
from sluice.workers.backends import triton_python_backend_utils as pb
from sluice.workers.backends.base import (
    Answered,
    CancelSignal,
    Emit,
    PartialOutputs,
    RequestsFailed,
    SequenceFlags,
)
from sluice.workers.backends.python_model import call_model, forget_module
from sluice.workers.ragged import RaggedOutputs
from sluice.workers.serving import serving

FINAL_WAIT_S = 300.0
"""How long a decoupled model may take to send every request's final response."""

_ERROR_BY_CODE: dict[int, type[SluiceError]] = {
    pb.TritonError.INVALID_ARG: InvalidInput,
    pb.TritonError.NOT_FOUND: NotFound,
    pb.TritonError.UNAVAILABLE: Unavailable,
    pb.TritonError.UNSUPPORTED: Unsupported,
}


def _as_sluice_error(error: pb.TritonError) -> SluiceError:
    return _ERROR_BY_CODE.get(error.code(), InferenceFailed)(error.message())


def _filler(template: np.ndarray, items: int) -> np.ndarray:
    shape = (items, *template.shape[1:])
    if template.dtype == np.object_:
        filler = np.empty(shape, dtype=np.object_)
        filler.fill(b"")
        return filler
    return np.zeros(shape, dtype=template.dtype)


def _follow(
    requests: Sequence[pb.InferenceRequest], cancellations: Sequence[CancelSignal] | None
) -> Sequence[CancelSignal] | None:
    """Give each request its cancellation (``request.is_cancelled()``); the cancellations,
    or None when there are none for these requests."""
    if cancellations is None or len(cancellations) != len(requests):
        return None
    for request, signal in zip(requests, cancellations, strict=True):
        request._cancelled = signal  # type: ignore[attr-defined]
    return cancellations


class TritonPythonBackend:
    def __init__(
        self,
        instance: Any,
        config: ModelConfig,
        model_file: Path,
        placement: Placement,
        module_name: str,
    ) -> None:
        self._model = instance
        self._config = config
        self._file = model_file
        self._module_name = module_name
        self._version = int(model_file.parent.name) if model_file.parent.name.isdigit() else -1
        gpu = placement.kind == "KIND_GPU"
        device = placement.gpu or 0
        args = {
            "model_config": json.dumps(dict(config.raw)),
            "model_instance_kind": "GPU" if gpu else "CPU",
            "model_instance_name": f"{config.name}_0_{device}" if gpu else f"{config.name}_0",
            "model_instance_device_id": str(device),
            "model_repository": str(model_file.parent.parent),
            "model_version": model_file.parent.name,
            "model_name": config.name,
        }
        initialize = getattr(instance, "initialize", None)
        if initialize is not None:
            try:
                with pb.initializing():
                    call_model(model_file, "initialize", initialize, args)
            except SluiceError as exc:
                raise InvalidConfig(f"{model_file.name}: {exc.message}") from None

    follows_cancellation = True
    """``infer`` takes each request's cancellation (``request.is_cancelled()``, BLS calls),
    correlation id and flags."""

    def infer(
        self,
        inputs: Mapping[str, np.ndarray],
        outputs: Sequence[str],
        request_sizes: Sequence[int] | None = None,
        cancellations: Sequence[CancelSignal] | None = None,
        sequences: Sequence[SequenceFlags] | None = None,
        parameters: Sequence[Mapping[str, Any]] | None = None,
        response_parameters: list[dict[str, Any]] | None = None,
        tenants: Sequence[str] | None = None,
    ) -> dict[str, np.ndarray]:
        """``response_parameters``: filled with each request's response parameters (the
        ``parameters`` of its ``InferenceResponse``). ``tenants``: whose each request is (the
        BLS calls of a batch of one tenant's requests are that tenant's; those of a batch
        that mixes tenants are shared: :func:`~sluice.workers.serving.serving_tenant`)."""
        sizes = self._sizes(inputs, request_sizes)
        requests = self._requests(inputs, outputs, sizes, sequences, parameters)
        cancellations = _follow(requests, cancellations)
        pb.executing(cancellations)
        try:
            with serving(tenants or ()):
                responses = call_model(self._file, "execute", self._model.execute, requests)
        finally:
            pb.executing(None)
        if not isinstance(responses, list | tuple) or len(responses) != len(requests):
            got = len(responses) if isinstance(responses, list | tuple) else type(responses)
            raise InferenceFailed(
                f"{self._file.name}: execute must return one InferenceResponse per request "
                f"({len(requests)}), got {got}"
            )
        answers: list[dict[str, np.ndarray] | None] = []
        failures: dict[int, SluiceError] = {}
        for index, (response, items) in enumerate(zip(responses, sizes, strict=True)):
            answer = self._answer(response, outputs, items)
            if response_parameters is not None:  # (one entry per request, in order)
                own = (
                    response.parameters_dict() if isinstance(response, pb.InferenceResponse) else {}
                )
                response_parameters.append(own)
            if isinstance(answer, SluiceError):
                failures[index] = answer
                answers.append(None)
            else:
                answers.append(answer)
        merged = self._merge(answers, outputs, sizes)
        if failures:
            raise RequestsFailed(failures, merged)
        assert merged is not None
        return merged

    def infer_stream(
        self,
        inputs: Mapping[str, np.ndarray],
        outputs: Sequence[str],
        request_sizes: Sequence[int] | None,
        emit: Emit,
        cancellations: Sequence[CancelSignal] | None = None,
        sequences: Sequence[SequenceFlags] | None = None,
        parameters: Sequence[Mapping[str, Any]] | None = None,
        tenants: Sequence[str] | None = None,
    ) -> None:
        """A decoupled model: ``execute`` answers through each request's response sender,
        now or later from threads of its own; this returns once every request had its final
        response (or :data:`FINAL_WAIT_S` passed). Each request tells its cancellation and
        its sequence's correlation id and flags, as in :meth:`infer` (a streaming model
        stops once ``request.is_cancelled()``)."""
        sizes = self._sizes(inputs, request_sizes)
        requests = self._requests(inputs, outputs, sizes, sequences, parameters)
        cancellations = _follow(requests, cancellations)
        finished = [threading.Event() for _ in requests]
        for index, (request, items) in enumerate(zip(requests, sizes, strict=True)):

            def deliver(
                response: pb.InferenceResponse | None, final: bool, i: int = index, n: int = items
            ) -> None:
                emit(i, None if response is None else self._streamed(response, outputs, n), final)
                if final:
                    finished[i].set()

            sender = pb.InferenceResponseSender(deliver, request.is_cancelled)
            request._sender = sender  # type: ignore[attr-defined]
        pb.executing(cancellations)
        try:
            with serving(tenants or ()):
                call_model(self._file, "execute", self._model.execute, requests)
        finally:
            pb.executing(None)
        deadline = time.monotonic() + FINAL_WAIT_S
        for index, done in enumerate(finished):
            if not done.wait(max(0.0, deadline - time.monotonic())):
                late = InferenceFailed(
                    f"{self._file.name}: no final response (TRITONSERVER_RESPONSE_COMPLETE_FINAL)"
                    f" within {FINAL_WAIT_S:g} s"
                )
                emit(index, late, True)

    def _sizes(
        self, inputs: Mapping[str, np.ndarray], request_sizes: Sequence[int] | None
    ) -> list[int]:
        total = ragged.batch_items(inputs)
        if self._config.max_batch_size == 0 or total is None:
            return [1]
        if request_sizes is None:
            return [total]
        if sum(request_sizes) != total:
            raise InferenceFailed(
                f"request sizes {list(request_sizes)} do not add up to the batch of {total}"
            )
        return list(request_sizes)

    def _requests(
        self,
        inputs: Mapping[str, np.ndarray],
        outputs: Sequence[str],
        sizes: Sequence[int],
        sequences: Sequence[SequenceFlags] | None = None,
        parameters: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[pb.InferenceRequest]:
        """One request per client request; ``sequences``: each one's correlation id and
        flags (none: 0 and 0); ``parameters``: each one's own (``request.parameters()``)."""
        batched = self._config.max_batch_size > 0
        if sequences is None or len(sequences) != len(sizes):
            sequences = [(0, 0)] * len(sizes)
        if parameters is None or len(parameters) != len(sizes):
            parameters = [{}] * len(sizes)
        arrays = ragged.request_inputs(inputs, sizes, batched)
        return [
            pb.InferenceRequest(
                self._config.name,
                [pb.Tensor(name, array) for name, array in tensors.items()],
                outputs,
                model_version=self._version,
                correlation_id=correlation_id,
                flags=flags,
                parameters=own,
            )
            for tensors, (correlation_id, flags), own in zip(
                arrays, sequences, parameters, strict=True
            )
        ]

    def _streamed(
        self, response: Any, outputs: Sequence[str], items: int
    ) -> dict[str, np.ndarray] | SluiceError:
        """A decoupled model's response: its tensors, with its parameters."""
        answer = self._answer(response, outputs, items)
        if isinstance(answer, dict) and isinstance(response, pb.InferenceResponse):
            carried = response.parameters_dict()
            if carried:
                return Answered(answer, carried)
        return answer

    def _answer(
        self, response: Any, outputs: Sequence[str], items: int
    ) -> dict[str, np.ndarray] | SluiceError:
        if not isinstance(response, pb.InferenceResponse):
            return InferenceFailed(
                f"{self._file.name}: execute returned {type(response).__name__} "
                "where an InferenceResponse was expected"
            )
        error = response.error()
        if error is not None:
            return _as_sluice_error(error)
        tensors = {t.name(): t.as_numpy() for t in response.output_tensors()}
        answer: dict[str, np.ndarray] = {}
        for name in outputs:
            array = tensors.get(name)
            if array is None:
                continue  # answered without it, as Triton answers
            if self._config.max_batch_size > 0 and (array.ndim == 0 or array.shape[0] != items):
                return InferenceFailed(
                    f"{self._file.name}: output '{name}' has shape {list(array.shape)} for a "
                    f"request of {items} batch item(s)"
                )
            answer[name] = array
        return answer

    def _merge(
        self,
        answers: Sequence[dict[str, np.ndarray] | None],
        outputs: Sequence[str],
        sizes: Sequence[int],
    ) -> dict[str, np.ndarray] | None:
        """Whole-batch outputs; the rows of failed requests, and of requests answered
        without the output, hold zeros (or empty bytes); the latter are named
        (:class:`PartialOutputs`). An output whose shapes differ between the requests
        (past the batch dimension) stays each request's own (:class:`RaggedOutputs`)."""
        done = [answer for answer in answers if answer is not None]
        if not done:
            return None
        if len(answers) == 1:
            return done[0]
        merged: dict[str, np.ndarray] = {}
        absent: dict[int, set[str]] = {}
        own: dict[str, list[np.ndarray]] = {}
        for name in outputs:
            template = next((answer[name] for answer in done if name in answer), None)
            if template is None:
                continue  # no request has it
            parts: list[np.ndarray] = []
            for index, (answer, items) in enumerate(zip(answers, sizes, strict=True)):
                if answer is not None and name in answer:
                    parts.append(answer[name])
                    continue
                if answer is not None:
                    absent.setdefault(index, set()).add(name)
                parts.append(_filler(template, items))
            if ragged.differ(parts):
                own[name] = parts
                merged[name] = ragged.concatenated(parts)
            else:
                merged[name] = np.concatenate(parts, axis=0)
        lacking = {i: frozenset(names) for i, names in absent.items()}
        if own:
            return RaggedOutputs(merged, lacking, own)
        if absent:
            return PartialOutputs(merged, lacking)
        return merged

    def close(self) -> None:
        try:
            finalize = getattr(self._model, "finalize", None)
            if finalize is not None:
                call_model(self._file, "finalize", finalize)
        finally:
            forget_module(self._module_name, self._file)
