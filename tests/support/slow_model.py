"""A model whose compute time the request chooses, for fault and overload tests.

``IN`` FP32 [-1, 4] and ``ITERS`` INT64 [-1, 1] -> ``OUT`` FP32 [-1, 4] equal to ``IN``.
The batch runs ``max(ITERS)`` rounds of ``tanh(state @ W)`` on a [N, 256] state (an
ONNX Loop), and ``OUT = IN + 0 * sum(state)``, so the output depends on the loop and
onnxruntime cannot skip it. ``IN`` comes back exactly, so a marker put in it
identifies the answer.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from tests.support.onnx_models import save

WIDTH = 256


def slow_model() -> object:
    rng = np.random.default_rng(3)
    w0 = (rng.standard_normal((4, WIDTH)) * 0.1).astype(np.float32)
    w = (rng.standard_normal((WIDTH, WIDTH)) / np.sqrt(WIDTH)).astype(np.float32)
    body = helper.make_graph(
        [
            helper.make_node("Identity", ["cond_in"], ["cond_out"]),
            helper.make_node("MatMul", ["state_in", "W"], ["product"]),
            helper.make_node("Tanh", ["product"], ["state_out"]),
        ],
        "rounds",
        [
            helper.make_tensor_value_info("iteration", TensorProto.INT64, []),
            helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
            helper.make_tensor_value_info("state_in", TensorProto.FLOAT, [None, WIDTH]),
        ],
        [
            helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
            helper.make_tensor_value_info("state_out", TensorProto.FLOAT, [None, WIDTH]),
        ],
    )
    nodes = [
        helper.make_node("ReduceMax", ["ITERS"], ["iters_max"], keepdims=0),
        helper.make_node("MatMul", ["IN", "W0"], ["state0"]),
        helper.make_node("Loop", ["iters_max", "", "state0"], ["state"], body=body),
        helper.make_node("ReduceSum", ["state", "axis1"], ["total"], keepdims=1),
        helper.make_node("Mul", ["total", "zero"], ["nothing"]),
        helper.make_node("Add", ["IN", "nothing"], ["OUT"]),
    ]
    graph = helper.make_graph(
        nodes,
        "slow",
        [
            helper.make_tensor_value_info("IN", TensorProto.FLOAT, [None, 4]),
            helper.make_tensor_value_info("ITERS", TensorProto.INT64, [None, 1]),
        ],
        [helper.make_tensor_value_info("OUT", TensorProto.FLOAT, [None, 4])],
        initializer=[
            numpy_helper.from_array(w0, "W0"),
            numpy_helper.from_array(w, "W"),
            numpy_helper.from_array(np.array([1], dtype=np.int64), "axis1"),
            numpy_helper.from_array(np.array(0.0, dtype=np.float32), "zero"),
        ],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def write_slow(repository: Path, name: str, *, max_batch_size: int = 8, extra: str = "") -> Path:
    """Write the model and its config.pbtxt (``extra``: dynamic_batching, instance_group...)."""
    model_dir = repository / name
    save(slow_model(), model_dir / "1" / "model.onnx")  # type: ignore[arg-type]
    (model_dir / "config.pbtxt").write_text(
        f'name: "{name}"\nplatform: "onnxruntime_onnx"\nmax_batch_size: {max_batch_size}\n'
        'input [\n  { name: "IN" data_type: TYPE_FP32 dims: [ 4 ] },\n'
        '  { name: "ITERS" data_type: TYPE_INT64 dims: [ 1 ] }\n]\n'
        'output [\n  { name: "OUT" data_type: TYPE_FP32 dims: [ 4 ] }\n]\n'
        f"{extra}\n"
    )
    return model_dir
