"""Filling a config from an ONNX model, as Triton's onnxruntime backend does."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sluice.core.datatypes import to_config_type
from sluice.core.errors import InvalidConfig
from sluice.core.settings import DEFAULT_MAX_BATCH_SIZE

from ._schema import model_config_pb2, new_model_config
from .model import ModelConfig
from .parse import config_from_proto, config_to_proto
from .platforms import ONNX_BACKEND, ONNX_PLATFORM

# onnx.TensorProto.DataType values -> KServe datatypes.
_ONNX_TYPES: dict[int, str] = {
    1: "FP32",
    2: "UINT8",
    3: "INT8",
    4: "UINT16",
    5: "INT16",
    6: "INT32",
    7: "INT64",
    8: "BYTES",
    9: "BOOL",
    10: "FP16",
    11: "FP64",
    12: "UINT32",
    13: "UINT64",
    16: "BF16",
}


@dataclass(frozen=True, slots=True)
class _OnnxTensor:
    name: str
    datatype: str
    shape: tuple[int, ...]  # -1 where the model leaves the dimension open

    @property
    def batchable(self) -> bool:
        return bool(self.shape) and self.shape[0] == -1


def autocomplete_from_onnx(
    cfg_or_none: ModelConfig | None,
    model_path: Path,
    *,
    model_name: str,
    default_max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
) -> ModelConfig:
    """Complete (or create) a config from the inputs and outputs of an ONNX model. A
    created one batches, as in Triton, when every input and output has a variable first
    dimension: up to ``default_max_batch_size`` (0: no batching), with the dynamic batcher
    when that is over 1."""
    inputs, outputs = _read_onnx(model_path)
    if cfg_or_none is None:
        msg = new_model_config()
        msg.platform = ONNX_PLATFORM
        msg.backend = ONNX_BACKEND
        batchable = all(t.batchable for t in (*inputs, *outputs))
        if batchable and default_max_batch_size > 0:
            msg.max_batch_size = default_max_batch_size
            if default_max_batch_size > 1:
                msg.dynamic_batching.SetInParent()
    else:
        msg = config_to_proto(cfg_or_none)
    label = model_path.name
    if not msg.input:
        _fill(msg.input, inputs, msg.max_batch_size, "input", label)
    if not msg.output:
        _fill(msg.output, outputs, msg.max_batch_size, "output", label)
    return config_from_proto(msg, model_name=model_name, source=f"autocomplete from {label}")


def _fill(
    target: Any, tensors: list[_OnnxTensor], max_batch_size: int, kind: str, label: str
) -> None:
    data_type = model_config_pb2().DataType
    for tensor in tensors:
        shape = tensor.shape
        if max_batch_size > 0:
            if not tensor.batchable:
                raise InvalidConfig(
                    f"autocomplete from {label}: {kind} '{tensor.name}' has shape "
                    f"{list(shape)} but max_batch_size is {max_batch_size}; a batching "
                    "model needs a variable (-1) first dimension"
                )
            shape = shape[1:]
        entry = target.add()
        entry.name = tensor.name
        entry.data_type = data_type.Value(to_config_type(tensor.datatype))
        if shape:
            entry.dims.extend(shape)
        else:
            # Triton's convention for scalars: one element, reshaped to no dims.
            entry.dims.append(1)
            entry.reshape.SetInParent()


def _read_onnx(path: Path) -> tuple[list[_OnnxTensor], list[_OnnxTensor]]:
    import onnx

    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as exc:
        raise InvalidConfig(f"{path.name}: cannot read the ONNX model: {exc}") from None
    graph = model.graph
    if not graph.output:
        raise InvalidConfig(f"{path.name}: not a usable ONNX model (the graph has no outputs)")
    initializers = {init.name for init in graph.initializer}
    inputs = [_tensor(v, path) for v in graph.input if v.name not in initializers]
    outputs = [_tensor(v, path) for v in graph.output]
    return inputs, outputs


def _tensor(value_info: Any, path: Path) -> _OnnxTensor:
    name = value_info.name
    if value_info.type.WhichOneof("value") != "tensor_type":
        raise InvalidConfig(f"{path.name}: '{name}' is not a tensor; describe it in config.pbtxt")
    tensor_type = value_info.type.tensor_type
    datatype = _ONNX_TYPES.get(tensor_type.elem_type)
    if datatype is None:
        raise InvalidConfig(
            f"{path.name}: '{name}' has unsupported ONNX element type {tensor_type.elem_type}"
        )
    if not tensor_type.HasField("shape"):
        raise InvalidConfig(
            f"{path.name}: '{name}' has an unknown rank; describe it in config.pbtxt"
        )
    shape = tuple(
        d.dim_value if d.WhichOneof("value") == "dim_value" and d.dim_value > 0 else -1
        for d in tensor_type.shape.dim
    )
    return _OnnxTensor(name=name, datatype=datatype, shape=shape)
