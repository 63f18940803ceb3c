"""ONNX models built by the tests with the onnx helper API, and their config.pbtxt."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import onnx
from onnx import TensorProto, helper

ONNX_TYPES = {
    "BOOL": TensorProto.BOOL,
    "UINT8": TensorProto.UINT8,
    "UINT16": TensorProto.UINT16,
    "UINT32": TensorProto.UINT32,
    "UINT64": TensorProto.UINT64,
    "INT8": TensorProto.INT8,
    "INT16": TensorProto.INT16,
    "INT32": TensorProto.INT32,
    "INT64": TensorProto.INT64,
    "FP16": TensorProto.FLOAT16,
    "FP32": TensorProto.FLOAT,
    "FP64": TensorProto.DOUBLE,
    "BF16": TensorProto.BFLOAT16,
    "BYTES": TensorProto.STRING,
}
ALL_DATATYPES = tuple(ONNX_TYPES)


def save(model: onnx.ModelProto, path: Path) -> Path:
    model.ir_version = 9
    onnx.checker.check_model(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return path


def identity_model(datatypes: Sequence[str], dims: Sequence[int | None]) -> onnx.ModelProto:
    """One Identity per datatype: input ``IN_<DT>`` -> output ``OUT_<DT>``."""
    nodes, inputs, outputs = [], [], []
    for datatype in datatypes:
        elem = ONNX_TYPES[datatype]
        nodes.append(helper.make_node("Identity", [f"IN_{datatype}"], [f"OUT_{datatype}"]))
        inputs.append(helper.make_tensor_value_info(f"IN_{datatype}", elem, list(dims)))
        outputs.append(helper.make_tensor_value_info(f"OUT_{datatype}", elem, list(dims)))
    graph = helper.make_graph(nodes, "identity", inputs, outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def identity_config(
    name: str, datatypes: Sequence[str], dims: Sequence[int], max_batch_size: int, extra: str = ""
) -> str:
    def tensor(prefix: str, datatype: str) -> str:
        config_type = "TYPE_STRING" if datatype == "BYTES" else f"TYPE_{datatype}"
        shape = ", ".join(map(str, dims))
        return f'{{ name: "{prefix}_{datatype}" data_type: {config_type} dims: [ {shape} ] }}'

    inputs = ",\n  ".join(tensor("IN", dt) for dt in datatypes)
    outputs = ",\n  ".join(tensor("OUT", dt) for dt in datatypes)
    return (
        f'name: "{name}"\nplatform: "onnxruntime_onnx"\nmax_batch_size: {max_batch_size}\n'
        f"input [\n  {inputs}\n]\noutput [\n  {outputs}\n]\n{extra}\n"
    )


def write_identity(
    repository: Path,
    name: str,
    datatypes: Sequence[str] = ALL_DATATYPES,
    *,
    dims: Sequence[int] = (-1,),
    max_batch_size: int = 8,
    extra: str = "",
) -> Path:
    model_dir = repository / name
    model_dims: list[int | None] = [None if d == -1 else d for d in dims]
    if max_batch_size > 0:
        model_dims.insert(0, None)
    save(identity_model(datatypes, model_dims), model_dir / "1" / "model.onnx")
    (model_dir / "config.pbtxt").write_text(
        identity_config(name, datatypes, dims, max_batch_size, extra)
    )
    return model_dir


RAGGED_CONFIG = """name: "{name}"
backend: "onnxruntime"
max_batch_size: 8
input [ {{ name: "INPUT" data_type: TYPE_FP32 dims: [ -1 ] allow_ragged_batch: true }} ]
output [
  {{ name: "OUT" data_type: TYPE_FP32 dims: [ -1 ] }},
  {{ name: "LAST" data_type: TYPE_FP32 dims: [ 1 ] }}
]
batch_input [ {{ kind: BATCH_ACCUMULATED_ELEMENT_COUNT target_name: "INDEX"
                data_type: TYPE_FP32 source_input: "INPUT" }} ]
batch_output [ {{ target_name: "OUT" kind: BATCH_SCATTER_WITH_INPUT_SHAPE source_input: "INPUT" }} ]
dynamic_batching {{ preferred_batch_size: [ {batch} ] max_queue_delay_microseconds: 10000000 }}
parameters {{ key: "adaptive_batching" value {{ string_value: "false" }} }}
"""


def write_ragged(repository: Path, name: str, batch: int = 3) -> Path:
    """Triton's ragged batching example: ``INPUT`` (ragged, FP32) reaches the model as the
    batch's elements in one dimension, with ``INDEX`` (BATCH_ACCUMULATED_ELEMENT_COUNT)
    beside it. ``OUT`` = 2 x INPUT, scattered back by each request's INPUT shape; ``LAST`` =
    the request's running element count in its batch. A batch closes at ``batch``
    requests (its preferred size) or after 10 s."""
    inputs = [
        helper.make_tensor_value_info("INPUT", TensorProto.FLOAT, [None]),
        helper.make_tensor_value_info("INDEX", TensorProto.FLOAT, [None]),
    ]
    outputs = [
        helper.make_tensor_value_info("OUT", TensorProto.FLOAT, [None]),
        helper.make_tensor_value_info("LAST", TensorProto.FLOAT, [None, 1]),
    ]
    two = helper.make_tensor("two", TensorProto.FLOAT, [], [2.0])
    column = helper.make_tensor("column", TensorProto.INT64, [2], [-1, 1])
    nodes = [
        helper.make_node("Mul", ["INPUT", "two"], ["OUT"]),
        helper.make_node("Reshape", ["INDEX", "column"], ["LAST"]),
    ]
    graph = helper.make_graph(nodes, "ragged", inputs, outputs, initializer=[two, column])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model_dir = repository / name
    save(model, model_dir / "1" / "model.onnx")
    (model_dir / "config.pbtxt").write_text(RAGGED_CONFIG.format(name=name, batch=batch))
    return model_dir
