"""The common subset of Triton's ``triton_python_backend_utils``, for models written for
Triton's Python backend. Sluice registers this module under that name before it
imports a ``model.py``, so ``import triton_python_backend_utils as pb_utils`` works.

Not provided: BLS (``InferenceRequest.exec``), decoupled response senders,
GPU tensors (every tensor is a CPU numpy array), custom metrics.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from sluice import datatypes
from sluice.config import model_config_pb2
from sluice.errors import Unsupported

_log = logging.getLogger("model.py")


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
        return False

    def get_response_sender(self) -> Any:
        raise Unsupported("decoupled models (response senders) are not supported by Sluice")

    def exec(self, *args: Any, **kwargs: Any) -> Any:
        raise Unsupported("BLS (InferenceRequest.exec) is not supported by Sluice")

    async def async_exec(self, *args: Any, **kwargs: Any) -> Any:
        raise Unsupported("BLS (InferenceRequest.async_exec) is not supported by Sluice")


class InferenceResponse:
    def __init__(
        self,
        output_tensors: Iterable[Tensor] = (),
        error: TritonError | str | None = None,
        parameters: Mapping[str, Any] | str | None = None,
    ) -> None:
        self._outputs = list(output_tensors)
        self._error = TritonError(error) if isinstance(error, str) else error

    def output_tensors(self) -> list[Tensor]:
        return list(self._outputs)

    def has_error(self) -> bool:
        return self._error is not None

    def error(self) -> TritonError | None:
        return self._error


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
    """``pb_utils.Logger.log_info(...)`` and friends, onto the worker's log."""

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
