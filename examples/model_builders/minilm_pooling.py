"""The sentence-embedding example's last step: mean pooling and L2 normalisation."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from onnx import TensorProto, helper

from examples.model_builders.minilm import MINILM_HIDDEN
from examples.model_builders.onnx_files import default_opset_model, finish, initializer


def build_minilm_pooling(directory: Path | str) -> Path:
    """Mean pooling over the attended tokens, then L2 normalisation, as sentence-transformers
    does for all-MiniLM-L6-v2 (token count clamped at 1e-9, norm at 1e-12).

    ``last_hidden_state`` FP32 [N,L,384], ``attention_mask`` INT64 [N,L] -> ``EMBEDDING``
    FP32 [N,384]. Ten ONNX nodes rather than a Python model: onnxruntime runs them in
    C++ without the GIL or a Python call per batch, and takes the hidden states as they
    come (no copy into Python objects).
    """
    nodes = [
        helper.make_node("Cast", ["attention_mask"], ["mask_f"], name="MaskCast", to=1),
        helper.make_node("Unsqueeze", ["mask_f", "last_axis"], ["mask_3d"], name="MaskExpand"),
        helper.make_node("Mul", ["last_hidden_state", "mask_3d"], ["masked"], name="Masked"),
        helper.make_node("ReduceSum", ["masked", "token_axis"], ["summed"], keepdims=0, name="Sum"),
        helper.make_node(
            "ReduceSum", ["mask_3d", "token_axis"], ["count_raw"], keepdims=0, name="Count"
        ),
        helper.make_node("Max", ["count_raw", "min_count"], ["count"], name="ClampCount"),
        helper.make_node("Div", ["summed", "count"], ["mean"], name="Mean"),
        helper.make_node("ReduceL2", ["mean"], ["norm_raw"], axes=[1], keepdims=1, name="Norm"),
        helper.make_node("Max", ["norm_raw", "min_norm"], ["norm"], name="ClampNorm"),
        helper.make_node("Div", ["mean", "norm"], ["EMBEDDING"], name="Normalize"),
    ]
    graph = helper.make_graph(
        nodes,
        "minilm_pooling",
        [
            helper.make_tensor_value_info(
                "last_hidden_state", TensorProto.FLOAT, ["batch", "sequence", MINILM_HIDDEN]
            ),
            helper.make_tensor_value_info(
                "attention_mask", TensorProto.INT64, ["batch", "sequence"]
            ),
        ],
        [helper.make_tensor_value_info("EMBEDDING", TensorProto.FLOAT, ["batch", MINILM_HIDDEN])],
        initializer=[
            initializer("last_axis", np.array([2], dtype=np.int64)),
            initializer("token_axis", np.array([1], dtype=np.int64)),
            initializer("min_count", np.array(1e-9, dtype=np.float32)),
            initializer("min_norm", np.array(1e-12, dtype=np.float32)),
        ],
    )
    return finish(default_opset_model(graph), directory)
