"""Triton's ragged batching, as the model configuration states it.

- An input with ``allow_ragged_batch: true`` lets requests whose shapes differ share a
  batch: the model receives the requests' elements of that input concatenated into one
  1-dimensional tensor (as Triton's onnxruntime, TensorFlow, PyTorch and TensorRT backends
  give it).
- ``batch_input`` entries are inputs the server makes for each batch, since only it knows
  how the batch was formed: for the requests in order, the element counts of a source input
  (``BATCH_ELEMENT_COUNT``), their running sums (``BATCH_ACCUMULATED_ELEMENT_COUNT``, with a
  leading 0: ``..._WITH_ZERO``), a tensor whose shape is the largest count
  (``BATCH_MAX_ELEMENT_COUNT_AS_SHAPE``), or each batch item's shape
  (``BATCH_ITEM_SHAPE``, ``BATCH_ITEM_SHAPE_FLATTEN``).
- ``batch_output`` entries (``BATCH_SCATTER_WITH_INPUT_SHAPE``) say that an output comes
  concatenated as a ragged input goes in: each request gets the part of it with the shape
  of its own source input (the output's variable dimensions take that input's sizes).

The worker does the batching (:mod:`sluice.workers.ragged`); here are the typed view and
the checks made when the configuration is read. A Python model gets no concatenated batch:
as with Triton's Python backend, ``allow_ragged_batch`` lets requests whose shapes differ
share an ``execute`` call, each request keeping its own tensors. Triton's Python backend
makes no batch input and scatters no batch output (it reads only the requests' own
tensors), so Sluice refuses them for Python models rather than ignore them, as for
TorchServe handlers and ensembles, for which ``allow_ragged_batch`` has no effect
(requests of different shapes go in different batches).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sluice.core.datatypes import from_config_type

from ._schema import model_config_pb2

BATCH_INPUT_KINDS = (
    "BATCH_ELEMENT_COUNT",
    "BATCH_ACCUMULATED_ELEMENT_COUNT",
    "BATCH_ACCUMULATED_ELEMENT_COUNT_WITH_ZERO",
    "BATCH_MAX_ELEMENT_COUNT_AS_SHAPE",
    "BATCH_ITEM_SHAPE",
    "BATCH_ITEM_SHAPE_FLATTEN",
)
BATCH_INPUT_TYPES = ("INT32", "INT64", "FP32", "FP64")
"""The datatypes a batch input may take (its values are counts and sizes)."""


@dataclass(frozen=True, slots=True)
class BatchInput:
    kind: str
    target: str
    """The model input the server makes."""
    datatype: str
    source: str
    """The request input whose shapes it describes."""


@dataclass(frozen=True, slots=True)
class BatchOutput:
    targets: tuple[str, ...]
    """The outputs scattered back by the source input's shapes."""
    source: str


PYTHON_BACKEND = "python"
_PER_REQUEST_BACKENDS = frozenset({PYTHON_BACKEND, "torchserve"})


def keeps_request_shapes(backend: str) -> bool:
    """Whether a batch's ragged inputs reach the model request by request, each with its
    own shape (Triton's Python backend hands ``execute`` a list of requests), rather than
    concatenated into one tensor."""
    return backend == PYTHON_BACKEND


def takes_one_tensor(msg: Any) -> bool:
    """Whether the model's backend receives a batch as one tensor per input (so a ragged
    input can be concatenated), not request by request."""
    return (
        msg.max_batch_size > 0
        and msg.platform != "ensemble"
        and msg.backend not in _PER_REQUEST_BACKENDS
    )


def ragged_inputs(msg: Any) -> frozenset[str]:
    """The inputs whose shapes may differ between the requests of a batch
    (``allow_ragged_batch``, where it applies): concatenated for a backend that takes one
    tensor per input, each request's own for a Python model."""
    if not takes_one_tensor(msg) and not (
        msg.max_batch_size > 0 and keeps_request_shapes(msg.backend)
    ):
        return frozenset()
    return frozenset(t.name for t in msg.input if t.allow_ragged_batch)


def build_batch_inputs(msg: Any) -> tuple[BatchInput, ...]:
    pb2 = model_config_pb2()
    return tuple(
        BatchInput(
            kind=pb2.BatchInput.Kind.Name(entry.kind),
            target=entry.target_name[0],
            datatype=from_config_type(pb2.DataType.Name(entry.data_type)),
            source=entry.source_input[0],
        )
        for entry in msg.batch_input
    )


def build_batch_outputs(msg: Any) -> tuple[BatchOutput, ...]:
    return tuple(
        BatchOutput(targets=tuple(entry.target_name), source=entry.source_input[0])
        for entry in msg.batch_output
    )


def ragged_problem(msg: Any) -> str | None:
    """What is wrong with the configuration's batch inputs and outputs, if anything."""
    if not msg.batch_input and not msg.batch_output:
        return None
    if msg.max_batch_size == 0:
        return "batch_input and batch_output need a model that batches (max_batch_size > 0)"
    if not takes_one_tensor(msg):
        backend = msg.backend or msg.platform
        why = (
            " (Triton's Python backend ignores them: each request of an execute call keeps "
            "its own tensors)"
            if keeps_request_shapes(msg.backend)
            else ""
        )
        return (
            "batch_input and batch_output are made for backends that take a batch as one "
            f"tensor per input, not for '{backend}'{why}"
        )
    inputs = {tensor.name for tensor in msg.input}
    outputs = {tensor.name for tensor in msg.output}
    pb2 = model_config_pb2()
    targets: set[str] = set()
    for index, entry in enumerate(msg.batch_input):
        where = f"batch_input #{index}"
        if len(entry.target_name) != 1 or not entry.target_name[0]:
            return f"{where}: target_name must name one model input"
        target = entry.target_name[0]
        where = f"batch_input '{target}'"
        if target in inputs or target in targets:
            return f"{where}: target_name is already an input of the model"
        targets.add(target)
        if len(entry.source_input) != 1 or entry.source_input[0] not in inputs:
            return f"{where}: source_input must name one input of the model"
        type_name = pb2.DataType.Name(entry.data_type)
        if type_name.removeprefix("TYPE_") not in BATCH_INPUT_TYPES:
            allowed = ", ".join(f"TYPE_{t}" for t in BATCH_INPUT_TYPES)
            return f"{where}: data_type must be one of {allowed}, not {type_name}"
    scattered: set[str] = set()
    for index, entry in enumerate(msg.batch_output):
        where = f"batch_output #{index}"
        if not entry.target_name:
            return f"{where}: target_name must name the outputs to scatter"
        for name in entry.target_name:
            if name not in outputs:
                return f"{where}: target_name '{name}' is not an output of the model"
            if name in scattered:  # (by which source input would it be scattered?)
                return f"{where}: target_name '{name}' is named twice"
            scattered.add(name)
        if len(entry.source_input) != 1 or entry.source_input[0] not in inputs:
            return f"{where}: source_input must name one input of the model"
    return None
