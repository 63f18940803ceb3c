"""The cnn example: a compute-bound small CNN with seeded weights."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from examples.model_builders.onnx_files import default_opset_model, finish, initializer

CNN_CHANNELS = (48, 96, 128, 256)  # one stage per entry, at 64, 32, 16 and 8 pixels square
CNN_CONVS_PER_STAGE = 2  # 3x3 Conv+Relu pairs before each MaxPool(2)
CNN_IMAGE, CNN_CLASSES = 64, 10


def _conv_relu(
    rng: np.random.Generator, name: str, source: str, channels_in: int, channels_out: int
) -> tuple[list[onnx.NodeProto], list[TensorProto]]:
    """A 3x3 same-padded Conv (He-initialised) followed by Relu; output tensor ``name``."""
    weight = rng.standard_normal((channels_out, channels_in, 3, 3)) * np.sqrt(
        2.0 / (channels_in * 9)
    )
    bias = rng.standard_normal(channels_out) * 0.01
    nodes = [
        helper.make_node(
            "Conv",
            [source, f"{name}_w", f"{name}_b"],
            [f"{name}_conv"],
            name=f"Conv_{name}",
            kernel_shape=[3, 3],
            pads=[1, 1, 1, 1],
        ),
        helper.make_node("Relu", [f"{name}_conv"], [name], name=f"Relu_{name}"),
    ]
    weights = [
        initializer(f"{name}_w", weight.astype(np.float32)),
        initializer(f"{name}_b", bias.astype(np.float32)),
    ]
    return nodes, weights


def build_cnn(directory: Path | str) -> Path:
    """A compute-bound small CNN: ``input`` FP32 [N,3,64,64] -> ``output`` [N,10].

    Four stages of two Conv3x3+Relu and a MaxPool, then GlobalAveragePool, Flatten
    and Gemm; seeded weights. About 0.7 GFLOP per item: ~3 ms per item on one core
    (onnxruntime, one intra-op thread, batch 8).
    """
    rng = np.random.default_rng(64)
    nodes: list[onnx.NodeProto] = []
    initializers: list[TensorProto] = []
    current, channels_in = "input", 3
    for stage, channels_out in enumerate(CNN_CHANNELS, start=1):
        for conv in range(1, CNN_CONVS_PER_STAGE + 1):
            name = f"stage{stage}_{conv}"
            new_nodes, weights = _conv_relu(rng, name, current, channels_in, channels_out)
            nodes += new_nodes
            initializers += weights
            current, channels_in = name, channels_out
        pooled = f"stage{stage}_pool"
        nodes.append(
            helper.make_node(
                "MaxPool",
                [current],
                [pooled],
                name=f"MaxPool_{stage}",
                kernel_shape=[2, 2],
                strides=[2, 2],
            )
        )
        current = pooled
    fc_w = rng.standard_normal((channels_in, CNN_CLASSES)) / np.sqrt(channels_in)
    initializers += [
        initializer("fc_w", fc_w.astype(np.float32)),
        initializer("fc_b", np.zeros(CNN_CLASSES, dtype=np.float32)),
    ]
    nodes += [
        helper.make_node("GlobalAveragePool", [current], ["gap"], name="GlobalAveragePool"),
        helper.make_node("Flatten", ["gap"], ["features"], name="Flatten", axis=1),
        helper.make_node("Gemm", ["features", "fc_w", "fc_b"], ["output"], name="Classifier"),
    ]
    graph = helper.make_graph(
        nodes,
        "cnn",
        [
            helper.make_tensor_value_info(
                "input", TensorProto.FLOAT, [None, 3, CNN_IMAGE, CNN_IMAGE]
            )
        ],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, [None, CNN_CLASSES])],
        initializer=initializers,
    )
    return finish(default_opset_model(graph), directory)
