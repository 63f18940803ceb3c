"""What every backend offers a worker."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from sluice.core.config import ModelConfig
from sluice.core.errors import InferenceFailed, InvalidConfig, SluiceError
from sluice.core.observability.trace_context import TraceParent
from sluice.core.placement import Placement


class CancelSignal:
    """Set once a request's caller went away (:mod:`sluice.workers.cancellations`); what
    works on the request's behalf on other threads registers a callback that stops it."""

    __slots__ = ("_callbacks", "_lock", "_set")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._set = False
        self._callbacks: list[Callable[[], object]] = []

    def is_set(self) -> bool:
        return self._set

    def add(self, callback: Callable[[], object]) -> None:
        """Call ``callback`` when the signal is set (at once if it is)."""
        with self._lock:
            if not self._set:
                self._callbacks.append(callback)
                return
        callback()

    def set(self) -> None:
        with self._lock:
            self._set = True
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback()


SequenceFlags = tuple[int | str, int]
"""A request's correlation id and flags, as Triton's core records them (0 and 0 when it
names no sequence; :func:`sluice.core.sequences.request_sequence`)."""


@dataclass(frozen=True, slots=True)
class RequestContext:
    """What a request carries beyond its tensors, for backends that make requests of their
    own on its behalf (an ensemble's steps): they inherit its deadline and ids, and stop
    when it is cancelled."""

    request_id: str
    deadline_ns: int
    """Unix ns; 0: none."""
    trace: TraceParent | None
    priority: int = 0
    cancelled: CancelSignal | None = None
    """Set when the request's caller goes away while it computes."""
    outputs: tuple[str, ...] = ()
    """The outputs this request asked for (empty: those the batch asks for)."""
    sequence: SequenceFlags = (0, 0)
    """The request's correlation id and flags, which the requests made on its behalf carry
    (Triton's ensemble gives them to every step)."""
    parameters: Mapping[str, Any] = field(default_factory=dict)
    """The request's own parameters (:func:`sluice.core.request_parameters.model_parameters`),
    which an ensemble passes on to each step, as Triton's does."""
    tenant: str = ""
    """Whose request it is (empty: the anonymous tenant): the requests made on its behalf
    are that tenant's too, in the called models' fair shares and statistics."""


class Answered(dict[str, np.ndarray]):
    """A response's output tensors, with the parameters the response carries (Triton's
    response parameters: a Python model's, or a called model's)."""

    parameters: dict[str, Any]

    def __init__(self, tensors: Mapping[str, np.ndarray], parameters: Mapping[str, Any]):
        super().__init__(tensors)
        self.parameters = dict(parameters)


Emit = Callable[[int, "Mapping[str, np.ndarray] | SluiceError | None", bool], None]
"""How a decoupled model's backend hands over a response: ``emit(index, outputs, final)``
for the batch's request ``index``; outputs None (only with ``final``): no more responses;
an error ends the request's responses."""


class Backend(Protocol):
    """``concurrency`` (optional attribute, default 1): how many batches the worker may
    compute at once (see :mod:`sluice.workers.slots`). A backend that declares more than 1 is
    also called with ``contexts=``, one :class:`RequestContext` per request of the batch.
    ``computes_inline`` (optional, default False): the backend never calls back into the
    worker's event loop, so a short batch may compute on the loop itself
    (:data:`sluice.workers.execution.INLINE_MAX_S`)."""

    def infer(
        self,
        inputs: Mapping[str, np.ndarray],
        outputs: Sequence[str],
        request_sizes: Sequence[int] | None = None,
    ) -> dict[str, np.ndarray]:
        """Run one batch of named arrays; return the named outputs asked for.

        ``request_sizes``: the batch items of each request in the batch, in order
        (they sum to the batch dimension; one entry for models without batching).
        Backends that answer requests one by one (Triton-style Python models) use it;
        ``None`` means the whole batch is one request.
        """
        ...

    def close(self) -> None: ...


class ConcurrentBackend(Protocol):
    """A backend with ``concurrency`` > 1, as the worker calls it."""

    concurrency: int

    def infer(
        self,
        inputs: Mapping[str, np.ndarray],
        outputs: Sequence[str],
        request_sizes: Sequence[int] | None = None,
        contexts: Sequence[RequestContext] | None = None,
    ) -> dict[str, np.ndarray]: ...

    def close(self) -> None: ...


class FollowsCancellation(Protocol):
    """A backend that declares ``follows_cancellation = True`` (a Triton-style Python
    model), as the worker calls it: with each request's :class:`CancelSignal` (None when the
    worker watches no cancellations), its correlation id and flags, and its tenant."""

    follows_cancellation: bool

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
    ) -> dict[str, np.ndarray]: ...


class ReadsParameters(Protocol):
    """A backend that declares ``reads_parameters = True`` (TorchServe's handlers), as the
    worker calls it: with each request's parameters as the gateway sent them, those Triton
    reserves for the server included (a route's mark: an explanation,
    :mod:`sluice.core.torchserve.explanations`); it fills ``response_parameters`` with
    each request's reply parameters (a handler's status:
    :mod:`sluice.core.torchserve.statuses`)."""

    reads_parameters: bool

    def infer(
        self,
        inputs: Mapping[str, np.ndarray],
        outputs: Sequence[str],
        request_sizes: Sequence[int] | None = None,
        parameters: Sequence[Mapping[str, Any]] | None = None,
        response_parameters: list[dict[str, Any]] | None = None,
    ) -> dict[str, np.ndarray]: ...


class BackendFactory(Protocol):
    def __call__(self, config: ModelConfig, model_path: Path, placement: Placement) -> Backend: ...


def missing_extra(model: str, what: str, extra: str) -> InvalidConfig:
    """The load error of a model whose backend's package is not installed."""
    return InvalidConfig(
        f"model '{model}' needs {what}, which is not installed; install sluice[{extra}]"
    )


class PartialOutputs(dict[str, np.ndarray]):
    """Whole-batch outputs where some requests lack outputs they asked for (a Triton-style
    Python model's response without them, an ensemble whose composing model did not produce
    them): ``absent[i]`` names those request ``i`` lacks; their rows hold filler. Answers
    leave them out, as Triton's do. (An output no request has is simply not in the dict.)"""

    def __init__(
        self, arrays: Mapping[str, np.ndarray], absent: Mapping[int, frozenset[str]]
    ) -> None:
        super().__init__(arrays)
        self.absent = dict(absent)


def absent_outputs(outputs: Mapping[str, np.ndarray]) -> dict[int, frozenset[str]]:
    """Each request's outputs left out of ``outputs`` (see :class:`PartialOutputs`)."""
    return outputs.absent if isinstance(outputs, PartialOutputs) else {}


class RequestsFailed(InferenceFailed):
    """Some requests of a batch failed, the others have answers.

    ``outputs`` are whole-batch arrays as :meth:`Backend.infer` returns them (the
    rows of failed requests hold filler), or ``None`` when every request failed.
    ``failures`` maps the index of a request in the batch to its error.
    """

    def __init__(
        self, failures: Mapping[int, SluiceError], outputs: dict[str, np.ndarray] | None
    ) -> None:
        first = failures[min(failures)]
        if outputs is None and len({error.message for error in failures.values()}) == 1:
            message = first.message
        else:
            message = f"{len(failures)} request(s) of the batch failed; first: {first.message}"
        super().__init__(message)
        self.failures = dict(failures)
        self.outputs = outputs
