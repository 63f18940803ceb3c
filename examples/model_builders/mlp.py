"""The mlp example: a tiny overhead-bound Gemm/Relu/Gemm with seeded weights."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from onnx import TensorProto, helper

from examples.model_builders.onnx_files import default_opset_model, finish, initializer

MLP_INPUT, MLP_HIDDEN, MLP_OUTPUT = 16, 32, 4


def mlp_weights() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(w1, b1, w2, b2)`` of the mlp example (seeded), shared by its ONNX and torch forms."""
    rng = np.random.default_rng(16)
    w1 = (rng.standard_normal((MLP_INPUT, MLP_HIDDEN)) / np.sqrt(MLP_INPUT)).astype(np.float32)
    b1 = (rng.standard_normal(MLP_HIDDEN) * 0.1).astype(np.float32)
    w2 = (rng.standard_normal((MLP_HIDDEN, MLP_OUTPUT)) / np.sqrt(MLP_HIDDEN)).astype(np.float32)
    b2 = (rng.standard_normal(MLP_OUTPUT) * 0.1).astype(np.float32)
    return w1, b1, w2, b2


def build_mlp(directory: Path | str) -> Path:
    """A tiny overhead-bound MLP: ``input`` FP32 [N,16] -> Gemm/Relu/Gemm -> ``output`` [N,4]."""
    w1, b1, w2, b2 = mlp_weights()
    nodes = [
        helper.make_node("Gemm", ["input", "w1", "b1"], ["hidden_pre"], name="Gemm1"),
        helper.make_node("Relu", ["hidden_pre"], ["hidden"], name="Relu1"),
        helper.make_node("Gemm", ["hidden", "w2", "b2"], ["output"], name="Gemm2"),
    ]
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, [None, MLP_INPUT])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, [None, MLP_OUTPUT])],
        initializer=[
            initializer("w1", w1),
            initializer("b1", b1),
            initializer("w2", w2),
            initializer("b2", b2),
        ],
    )
    return finish(default_opset_model(graph), directory)
