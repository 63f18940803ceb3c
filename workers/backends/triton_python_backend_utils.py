"""The common subset of Triton's ``triton_python_backend_utils``, for models written for
Triton's Python backend. Sluice registers this module under that name before it
imports a ``model.py``, so ``import triton_python_backend_utils as pb_utils`` works.

BLS (business logic scripting): ``InferenceRequest(model_name=..., inputs=...,
requested_output_names=...).exec()`` (and ``await ....async_exec()``) calls another model
served by the same deployment, through its stream, as an ensemble step does
(:mod:`sluice.workers.model_calls`); the answer is an ``InferenceResponse`` whose ``has_error()``
says whether the called model failed. ``timeout`` (microseconds) bounds the call.

Decoupled models (``model_transaction_policy { decoupled: true }``) answer through
``request.get_response_sender().send(response, flags)``; a BLS call of one,
``exec(decoupled=True)`` (or ``await async_exec(decoupled=True)``), gives an iterator of
its responses as they come, the last possibly without outputs, which ``cancel()``
withdraws.

Custom metrics (``MetricFamily``, its ``Metric``) show on ``GET /metrics``
(:mod:`sluice.core.observability.custom_metrics`).

Not provided: GPU tensors (every tensor is a CPU numpy array).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import queue
import threading
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
)
from concurrent.futures import CancelledError, Future
from typing import Any, cast

import numpy as np

from sluice.core import datatypes
from sluice.core.clock import CLOCK
from sluice.core.config import model_config_pb2
from sluice.core.control import ControlCommand
from sluice.core.errors import (
    Cancelled,
    InvalidInput,
    NotFound,
    SluiceError,
    Unavailable,
    Unsupported,
)
from sluice.core.observability import custom_metrics as metrics
from sluice.core.request_parameters import model_parameters
from sluice.workers.backends.base import CancelSignal
from sluice.workers.model_calls import CallContext, ModelCalls, process_calls
from sluice.workers.serving import serving_tenant

_log = logging.getLogger("model.py")
_LOG_LEVELS = frozenset((logging.INFO, logging.WARNING, logging.ERROR, logging.DEBUG))


class TritonError(Exception):
    """An error a response carries (``InferenceResponse(error=TritonError(...))``)."""

    UNKNOWN = 0
    INTERNAL = 1
    NOT_FOUND = 2
    INVALID_ARG = 3
    UNAVAILABLE = 4
    UNSUPPORTED = 5
    ALREADY_EXISTS = 6
    CANCELLED = 7

    def __init__(self, message: str, code: int = INTERNAL) -> None:
        super().__init__(message)
        self._message = message
        self._code = code

    def message(self) -> str:
        return self._message

    def code(self) -> int:
        return self._code


class TritonModelException(Exception):
    """Raised by a model to fail the whole ``execute`` call."""


class Tensor:
    def __init__(self, name: str, data: Any) -> None:
        self._name = name
        self._data = np.asarray(data)

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray:
        return self._data

    def shape(self) -> list[int]:
        return list(self._data.shape)

    def is_cpu(self) -> bool:
        return True

    def to_dlpack(self) -> Any:
        """An object implementing ``__dlpack__`` (torch.from_dlpack accepts it)."""
        return self._data

    @staticmethod
    def from_dlpack(name: str, capsule: Any) -> Tensor:
        return Tensor(name, np.from_dlpack(capsule))

    def __repr__(self) -> str:
        return f"Tensor({self._name!r}, shape={list(self._data.shape)}, dtype={self._data.dtype})"


TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
"""``InferenceResponseSender.send`` flag: the request's last response."""
TRITONSERVER_REQUEST_FLAG_SEQUENCE_START = 1
TRITONSERVER_REQUEST_FLAG_SEQUENCE_END = 2


class InferenceResponseSender:
    """A decoupled model's way to answer a request any number of times, from ``execute`` or
    from a thread of its own; the last ``send`` carries ``TRITONSERVER_RESPONSE_COMPLETE_FINAL``."""

    def __init__(
        self,
        deliver: Callable[[InferenceResponse | None, bool], None],
        cancelled: Callable[[], bool] = lambda: False,
    ) -> None:
        """``cancelled``: whether the request's caller went away (its request's
        ``is_cancelled``)."""
        self._deliver = deliver
        self._cancelled = cancelled
        self._closed = False
        self._lock = threading.Lock()

    def send(self, response: InferenceResponse | None = None, flags: int = 0) -> None:
        final = bool(flags & TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        with self._lock:
            if self._closed:
                raise TritonModelException(
                    "Unable to send response. Response sender has been closed."
                )
            if response is None and not final:
                raise TritonModelException("send needs a response, or the FINAL flag")
            self._closed = final
            self._deliver(response, final)

    def is_cancelled(self) -> bool:
        """Whether the request's caller went away (as Triton's): a streaming model may stop
        sending and close the stream with the FINAL flag."""
        return self._cancelled()


class InferenceRequest:
    """One client request as ``execute`` sees it."""

    def __init__(
        self,
        model_name: str = "",
        inputs: Sequence[Tensor] = (),
        requested_output_names: Sequence[str] = (),
        *,
        model_version: int = -1,
        request_id: str = "",
        correlation_id: int | str = 0,
        parameters: Mapping[str, Any] | str | None = None,
        flags: int = 0,
        timeout: int = 0,
        **_ignored: Any,
    ) -> None:
        self._model_name = model_name
        self._inputs = list(inputs)
        self._requested = list(requested_output_names)
        self._model_version = model_version
        self._request_id = request_id
        self._correlation_id = correlation_id
        if isinstance(parameters, str):
            self._parameters = parameters
        else:
            self._parameters = json.dumps(dict(parameters or {}))
        self._flags = flags
        self._timeout_us = timeout

    def inputs(self) -> list[Tensor]:
        return list(self._inputs)

    def requested_output_names(self) -> list[str]:
        return list(self._requested)

    def model_name(self) -> str:
        return self._model_name

    def model_version(self) -> int:
        return self._model_version

    def request_id(self) -> str:
        return self._request_id

    def correlation_id(self) -> int | str:
        return self._correlation_id

    def parameters(self) -> str:
        """The request parameters as a JSON string (as in Triton)."""
        return self._parameters

    def flags(self) -> int:
        return self._flags

    def is_cancelled(self) -> bool:
        """Whether the request's caller went away (as Triton's): a long ``execute`` may stop
        early and answer with an error, which nobody receives."""
        signal: CancelSignal | None = getattr(self, "_cancelled", None)
        return signal is not None and signal.is_set()

    def get_response_sender(self) -> InferenceResponseSender:
        sender = getattr(self, "_sender", None)
        if sender is None:
            raise TritonModelException(
                "get_response_sender is for decoupled models (model_transaction_policy "
                "{ decoupled: true })"
            )
        return cast(InferenceResponseSender, sender)

    def exec(self, decoupled: bool = False) -> Any:
        """Call ``model_name`` with this request (BLS); its answer, or its error (with
        ``decoupled``: a :class:`ResponseIterator` of its responses). Withdrawn when every
        request of the batch being executed is cancelled."""
        if decoupled:
            return self._stream()
        return _response(self._call().result)

    async def async_exec(self, decoupled: bool = False) -> Any:
        """:meth:`exec` for ``async def execute``: awaits the answer without blocking."""
        if decoupled:
            return self._stream()
        return await _async_response(asyncio.wrap_future(self._call()))

    def _call_args(self) -> tuple[Any, ...]:
        if not self._model_name:
            raise TritonModelException("InferenceRequest.exec needs a model_name")
        deadline_ns = CLOCK.now_ns() + self._timeout_us * 1000 if self._timeout_us else 0
        inputs = [(tensor.name(), "", tensor.as_numpy()) for tensor in self._inputs]
        tenant, shared = serving_tenant()
        context = CallContext(
            self._request_id,
            deadline_ns,
            sequence=(self._correlation_id, self._flags),
            parameters=self._call_parameters(),
            tenant=tenant,
            shared=shared,
        )
        return self._model_name, self._model_version, inputs, self._requested, context

    def _call_parameters(self) -> dict[str, Any]:
        """The parameters a BLS request carries to the model it calls (Triton's types:
        strings, integers, booleans; a float is taken too)."""
        try:
            parameters = json.loads(self._parameters)
        except ValueError:
            raise TritonModelException(
                "InferenceRequest parameters must be a JSON object"
            ) from None
        if not isinstance(parameters, dict) or not all(
            isinstance(v, str | int | float) for v in parameters.values()
        ):
            raise TritonModelException(
                "InferenceRequest parameters must map names to strings, integers or booleans"
            )
        return model_parameters(parameters)

    def _call(self) -> Future[Mapping[str, np.ndarray]]:
        """The call, started on the calls' loop (withdrawn with the executing batch)."""
        args = self._call_args()
        calls = process_calls()
        future: Future[Mapping[str, np.ndarray]] = asyncio.run_coroutine_threadsafe(
            calls.submit(*args), calls.loop
        )
        stop_with_batch(future)
        return future

    def _stream(self) -> ResponseIterator:
        args = self._call_args()
        calls = process_calls()
        return ResponseIterator(calls, calls.submit_stream(*args))


class ResponseIterator:
    """What a BLS call of a decoupled model gives: its responses as they come (a model that
    is not decoupled gives one), ending after the final one, which may have no outputs; an
    error ends them as a response that carries it. ``cancel()`` withdraws the call (a
    response with a ``CANCELLED`` error then ends them)."""

    def __init__(
        self,
        calls: ModelCalls,
        responses: AsyncIterator[tuple[Mapping[str, np.ndarray], bool]],
    ) -> None:
        self._queue: queue.Queue[InferenceResponse | None] = queue.Queue()
        self._future = asyncio.run_coroutine_threadsafe(self._pump(responses), calls.loop)
        stop_with_batch(self._future)

    async def _pump(self, responses: AsyncIterator[tuple[Mapping[str, np.ndarray], bool]]) -> None:
        try:
            async for tensors, _final in responses:
                self._queue.put(_answer(tensors))
        except SluiceError as exc:
            self._queue.put(_failure(exc))
        except asyncio.CancelledError:
            self._queue.put(_failure(_BLS_CANCELLED))
            raise
        finally:
            self._queue.put(None)

    def __iter__(self) -> ResponseIterator:
        return self

    def __next__(self) -> InferenceResponse:
        response = self._queue.get()
        if response is None:
            self._queue.put(None)  # (iterating again ends at once)
            raise StopIteration
        return response

    def cancel(self) -> None:
        self._future.cancel()


class InferenceResponse:
    def __init__(
        self,
        output_tensors: Iterable[Tensor] = (),
        error: TritonError | str | None = None,
        parameters: Mapping[str, Any] | str | None = None,
    ) -> None:
        self._outputs = list(output_tensors)
        self._error = TritonError(error) if isinstance(error, str) else error
        self._parameters = _response_parameters(parameters)

    def output_tensors(self) -> list[Tensor]:
        return list(self._outputs)

    def parameters(self) -> str:
        """The response's parameters as a JSON string (as in Triton)."""
        return json.dumps(self._parameters)

    def parameters_dict(self) -> dict[str, Any]:
        """The response's parameters, checked (what the worker puts on the reply)."""
        return dict(self._parameters)

    def has_error(self) -> bool:
        return self._error is not None

    def error(self) -> TritonError | None:
        return self._error


_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1
"""A response's integer parameter is Triton's ``int64_param`` (the reply entry, msgpack,
cannot carry more than 64 bits either)."""


def _response_parameters(parameters: Mapping[str, Any] | str | None) -> dict[str, Any]:
    """A response's parameters, checked as Triton's Python backend checks them: names to
    booleans, signed 64-bit integers or strings (a JSON object given as text too);
    ``triton_`` names are the server's."""
    if parameters is None:
        return {}
    if isinstance(parameters, str):
        try:
            parameters = json.loads(parameters)
        except ValueError:
            raise TritonModelException("response parameters must be a JSON object") from None
    if not isinstance(parameters, Mapping):
        raise TritonModelException("response parameters must be a dict")
    checked: dict[str, Any] = {}
    for name, value in parameters.items():
        if not isinstance(name, str) or name.startswith("triton_"):
            raise TritonModelException(
                f"response parameter {name!r}: names are strings, and triton_ ones are reserved"
            )
        if not isinstance(value, bool | int | str):
            raise TritonModelException(
                f"response parameter '{name}' must be a bool, int or str, "
                f"not {type(value).__name__}"
            )
        if isinstance(value, int) and not _INT64_MIN <= value <= _INT64_MAX:
            raise TritonModelException(
                f"response parameter '{name}' must fit in a signed 64-bit integer, got one "
                f"of {value.bit_length()} bits"
            )
        checked[name] = value
    return checked


def _answer(answer: Mapping[str, np.ndarray]) -> InferenceResponse:
    """A called model's answer as BLS gives it: its tensors and its response's parameters."""
    carried = getattr(answer, "parameters", None) or {}
    parameters = {
        name: value
        for name, value in carried.items()
        if not name.startswith("triton_") and isinstance(value, bool | int | str)
    }
    return InferenceResponse(
        [Tensor(name, array) for name, array in answer.items()], parameters=parameters
    )


_CODES: tuple[tuple[type[SluiceError], int], ...] = (
    (Cancelled, TritonError.CANCELLED),
    (InvalidInput, TritonError.INVALID_ARG),
    (NotFound, TritonError.NOT_FOUND),
    (Unavailable, TritonError.UNAVAILABLE),
    (Unsupported, TritonError.UNSUPPORTED),
)
"""The code of a called model's error, as Triton's BLS response error keeps the status's
(a model that answers with it fails its own request with the same status)."""


def _failure(exc: SluiceError) -> InferenceResponse:
    code = next((code for kind, code in _CODES if isinstance(exc, kind)), TritonError.INTERNAL)
    return InferenceResponse(error=TritonError(exc.message, code))


def _response(call: Callable[[], Mapping[str, np.ndarray]]) -> InferenceResponse:
    try:
        return _answer(call())
    except SluiceError as exc:
        return _failure(exc)
    except (CancelledError, asyncio.CancelledError):
        return _failure(_BLS_CANCELLED)


async def _async_response(call: Awaitable[Mapping[str, np.ndarray]]) -> InferenceResponse:
    try:
        return _answer(await call)
    except SluiceError as exc:
        return _failure(exc)
    except (CancelledError, asyncio.CancelledError):
        return _failure(_BLS_CANCELLED)


_BLS_CANCELLED = Cancelled("the BLS call was withdrawn: every request it served was cancelled")

_BATCH = threading.local()
"""The batch this compute thread executes: its cancellation signals (``signals``) and the
tenant its requests belong to (``tenant``)."""


def executing(signals: Sequence[CancelSignal] | None) -> None:
    """Say which batch this thread executes now (None: none): the BLS calls made meanwhile
    stop with it."""
    _BATCH.signals = signals


def stop_with_batch(future: Future[Any]) -> None:
    """Cancel ``future`` (a BLS call) once every request of the executing batch is."""
    signals: Sequence[CancelSignal] | None = getattr(_BATCH, "signals", None)
    if not signals:
        return
    remaining = [len(signals)]
    lock = threading.Lock()

    def one_more() -> None:
        with lock:
            remaining[0] -= 1
            last = remaining[0] == 0
        if last:
            future.cancel()

    for signal in signals:
        signal.add(one_more)


def get_input_tensor_by_name(request: InferenceRequest, name: str) -> Tensor | None:
    return next((t for t in request.inputs() if t.name() == name), None)


def get_output_tensor_by_name(response: InferenceResponse, name: str) -> Tensor | None:
    return next((t for t in response.output_tensors() if t.name() == name), None)


def _tensor_config(model_config: Mapping[str, Any], key: str, name: str) -> dict[str, Any] | None:
    return next((t for t in model_config.get(key, ()) if t.get("name") == name), None)


def get_input_config_by_name(model_config: Mapping[str, Any], name: str) -> dict[str, Any] | None:
    return _tensor_config(model_config, "input", name)


def get_output_config_by_name(model_config: Mapping[str, Any], name: str) -> dict[str, Any] | None:
    return _tensor_config(model_config, "output", name)


def triton_string_to_numpy(triton_type_string: str) -> type:
    """``"TYPE_FP32"`` -> ``np.float32``; TYPE_STRING is ``np.object_``; BF16 is float32."""
    try:
        datatype = datatypes.from_config_type(triton_type_string)
    except ValueError:
        raise TritonModelException(f"unknown Triton type {triton_type_string!r}") from None
    return datatypes.numpy_dtype(datatype).type


def triton_to_numpy_type(data_type: int) -> type:
    """A ``DataType`` enum value (TYPE_FP32 = 11 ...) -> numpy type."""
    return triton_string_to_numpy(model_config_pb2().DataType.Name(data_type))


def numpy_to_triton_type(data_type: Any) -> int:
    """numpy type -> ``DataType`` enum value (object and string kinds are TYPE_STRING)."""
    datatype = datatypes.from_numpy_dtype(np.dtype(data_type))
    return int(model_config_pb2().DataType.Value(datatypes.to_config_type(datatype)))


def serialize_byte_tensor(input_tensor: np.ndarray) -> np.ndarray:
    """Elements as Triton's length-prefixed bytes, in a 0-d object array (as tritonclient)."""
    if input_tensor.size == 0:
        return np.empty([0], dtype=np.object_)
    serialized = np.empty((), dtype=np.object_)
    serialized[()] = datatypes.serialize_bytes(input_tensor.reshape(-1, order="C"))
    return serialized


def deserialize_bytes_tensor(encoded_tensor: bytes | np.ndarray) -> np.ndarray:
    raw = encoded_tensor.tobytes() if isinstance(encoded_tensor, np.ndarray) else encoded_tensor
    elements = datatypes.deserialize_bytes(raw)
    array = np.empty(len(elements), dtype=np.object_)
    array[:] = elements
    return array


def using_decoupled_model_transaction_policy(model_config: Mapping[str, Any]) -> bool:
    return bool(model_config.get("model_transaction_policy", {}).get("decoupled", False))


class Logger:
    """``pb_utils.Logger.log_info(...)`` and friends, onto the worker's log; ``log(message,
    level)`` with ``Logger.INFO``, ``WARNING``, ``ERROR`` or ``VERBOSE`` (INFO when none)."""

    INFO = logging.INFO
    WARNING = logging.WARNING
    ERROR = logging.ERROR
    VERBOSE = logging.DEBUG

    @staticmethod
    def log(message: str, level: int = logging.INFO) -> None:
        _log.log(level if level in _LOG_LEVELS else logging.INFO, message)

    @staticmethod
    def log_info(message: str) -> None:
        _log.info(message)

    @staticmethod
    def log_warn(message: str) -> None:
        _log.warning(message)

    @staticmethod
    def log_error(message: str) -> None:
        _log.error(message)

    @staticmethod
    def log_verbose(message: str) -> None:
        _log.debug(message)


class MetricFamily:
    """Triton's custom metrics: ``MetricFamily(name, description, kind)`` then
    ``family.Metric(labels={...})`` (a histogram's with ``buckets=[...]``), whose
    ``increment``, ``set``, ``observe`` and ``value`` show on ``GET /metrics``
    (:mod:`sluice.core.observability.custom_metrics`). A bad name, label or value raises
    :class:`TritonModelException`.

    As in Triton, the family keeps the metrics made through it: they show while it lives,
    and deleting it deletes them from ``/metrics`` (the ``Metric`` objects left then raise
    on every operation). A model keeps its families as long as it uses their metrics."""

    COUNTER = 0
    GAUGE = 1
    HISTOGRAM = 2
    _KINDS: dict[int, metrics.Kind] = {0: "counter", 1: "gauge", 2: "histogram"}

    def __init__(self, name: str, description: str, kind: int) -> None:
        if kind not in self._KINDS:
            raise TritonModelException(f"invalid metric family kind {kind!r}")
        with _metric_errors():
            self._hold = metrics.REGISTRY.hold(name, description, self._KINDS[kind])

    def Metric(  # (Triton's name)
        self, labels: Mapping[str, str] | None = None, buckets: Sequence[float] | None = None
    ) -> Metric:
        with _metric_errors():
            return Metric(self._hold, self._hold.metric(labels, buckets))

    def __del__(self) -> None:
        hold = getattr(self, "_hold", None)  # (None: the constructor raised)
        if hold is not None:
            hold.release()


class Metric:
    """One series of a :class:`MetricFamily`."""

    def __init__(self, hold: metrics.FamilyHold, series: metrics.Series) -> None:
        self._hold, self._series = hold, series

    def increment(self, value: float) -> None:
        with _metric_errors():
            self._hold.increment(self._series, value)

    def set(self, value: float) -> None:
        with _metric_errors():
            self._hold.set(self._series, value)

    def observe(self, value: float) -> None:
        with _metric_errors():
            self._hold.observe(self._series, value)

    def value(self) -> float:
        with _metric_errors():
            if self._hold.family.kind == "histogram":
                raise metrics.MetricError(
                    f"histogram '{self._hold.family.name}' has no single value"
                )
            return self._hold.value(self._series)


@contextlib.contextmanager
def _metric_errors() -> Iterator[None]:
    try:
        yield
    except metrics.MetricError as exc:
        raise TritonModelException(str(exc)) from None


# -- the model loading API -------------------------------------------------------------------

LOAD_TIMEOUT_S = 125.0
"""How long ``load_model`` / ``unload_model`` wait for the executor (a gateway's
``SLUICE_MODEL_CONTROL_TIMEOUT_S`` default)."""

_initialize = threading.local()


@contextlib.contextmanager
def initializing() -> Iterator[None]:
    """The model's ``initialize`` runs meanwhile (on this thread)."""
    _initialize.active = True
    try:
        yield
    finally:
        _initialize.active = False


def is_model_ready(model_name: str, model_version: str = "") -> bool:
    """Whether ``model_name`` (``model_version``: a version number as text; empty: any of
    its versions) is loaded with a live instance now."""
    try:
        version = int(model_version) if model_version else -1
    except ValueError:
        raise TritonModelException(f"invalid model version '{model_version}'") from None
    calls = process_calls()
    return bool(calls.call_soon(calls.model_ready(model_name, version)))


def load_model(model_name: str, config: str = "", files: Mapping[str, bytes] | None = None) -> None:
    """Load ``model_name`` from the repository (explicit model control), with ``config``
    (the model configuration as JSON) and ``files`` (``{"file:<path>": bytes}``, which
    need ``config``) overriding its own, as the repository API's load does."""
    overrides: dict[str, bytes] = {}
    for key, content in (files or {}).items():
        if not key.startswith("file:") or not isinstance(content, bytes | bytearray):
            raise TritonModelException(f"file override '{key}': expected 'file:<path>' -> bytes")
        overrides[key.removeprefix("file:")] = bytes(content)
    _control(ControlCommand("load", model_name, config or None, overrides))


def unload_model(model_name: str, unload_dependents: bool = False) -> None:
    """Unload ``model_name`` (explicit model control); ``unload_dependents``: the models an
    ensemble calls too, as the repository API's unload does."""
    _control(ControlCommand("unload", model_name, dependents=unload_dependents))


def _control(command: ControlCommand) -> None:
    if getattr(_initialize, "active", False):
        raise TritonModelException(
            f"pb_utils.{command.op}_model('{command.model}') cannot run in initialize: Sluice's "
            "executor carries out one load at a time and is loading this model; load it "
            "beforehand (--load-model, or the repository API) or from execute"
        )
    calls = process_calls()
    try:
        calls.call_soon(calls.control(command, LOAD_TIMEOUT_S))
    except SluiceError as exc:
        raise TritonModelException(exc.message) from None
