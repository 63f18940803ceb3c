"""all-MiniLM-L6-v2's BERT encoder, written as an ONNX graph node by node."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from examples.model_builders.minilm import minilm_weights
from examples.model_builders.onnx_files import default_opset_model, finish, initializer


def _linear(
    nodes: list[onnx.NodeProto],
    weights: list[TensorProto],
    tensors: dict[str, np.ndarray],
    prefix: str,
    source: str,
    output: str,
) -> None:
    """``output = source @ W.T + b`` for the safetensors Linear ``prefix`` (weight [out, in])."""
    name = prefix.replace(".", "_")
    weights.append(initializer(f"{name}_wt", np.ascontiguousarray(tensors[f"{prefix}.weight"].T)))
    weights.append(initializer(f"{name}_b", tensors[f"{prefix}.bias"]))
    nodes.append(helper.make_node("MatMul", [source, f"{name}_wt"], [f"{name}_mm"], name=name))
    nodes.append(helper.make_node("Add", [f"{name}_mm", f"{name}_b"], [output], name=f"{name}_add"))


def _layer_norm(
    nodes: list[onnx.NodeProto],
    weights: list[TensorProto],
    tensors: dict[str, np.ndarray],
    prefix: str,
    source: str,
    output: str,
    epsilon: float,
) -> None:
    name = prefix.replace(".", "_")
    weights.append(initializer(f"{name}_gamma", tensors[f"{prefix}.weight"]))
    weights.append(initializer(f"{name}_beta", tensors[f"{prefix}.bias"]))
    nodes.append(
        helper.make_node(
            "LayerNormalization",
            [source, f"{name}_gamma", f"{name}_beta"],
            [output],
            name=name,
            axis=-1,
            epsilon=epsilon,
        )
    )


def build_minilm_transformer(directory: Path | str) -> Path:
    """all-MiniLM-L6-v2's BERT encoder as ONNX, written node by node with ``onnx.helper``.

    ``input_ids``, ``attention_mask`` INT64 [N,L] -> ``last_hidden_state`` FP32 [N,L,384].
    The graph is written by hand rather than exported from a torch module because (1) it
    is then independent of the torch reference (``examples/minilm_reference.py``) that the
    tests compare it with: a mistake in one shared BERT module would pass unnoticed; (2)
    the build needs no torch (an optional extra) and no exporter (the TorchScript one is
    deprecated, the dynamo one needs onnxscript); (3) it is byte-for-byte deterministic and
    takes about a second. Token type ids are not an input: a sentence embedding always
    uses type 0, whose embedding row is added to the position table at build time.
    Attention: per head [N,12,L,32], scores scaled by 1/sqrt(32), padded keys masked with
    the float32 minimum (as BERT does); Q, K and V come from one [384, 1152] MatMul.
    """
    tensors, config = minilm_weights()
    hidden = int(config["hidden_size"])  # type: ignore[call-overload]
    heads = int(config["num_attention_heads"])  # type: ignore[call-overload]
    layers = int(config["num_hidden_layers"])  # type: ignore[call-overload]
    epsilon = float(config["layer_norm_eps"])  # type: ignore[arg-type]
    if config.get("hidden_act") != "gelu" or config.get("position_embedding_type") != "absolute":
        raise ValueError("only BERT with exact GELU and absolute positions is supported")
    head_size = hidden // heads
    nodes: list[onnx.NodeProto] = []
    weights: list[TensorProto] = [
        initializer("word_embeddings", tensors["embeddings.word_embeddings.weight"]),
        initializer(
            "position_and_type_embeddings",
            tensors["embeddings.position_embeddings.weight"]
            + tensors["embeddings.token_type_embeddings.weight"][0],
        ),
        initializer("zero", np.array([0], dtype=np.int64)),
        initializer("one", np.array([1], dtype=np.int64)),
        initializer("mask_axes", np.array([1, 2], dtype=np.int64)),
        initializer("float_one", np.array(1.0, dtype=np.float32)),
        initializer("float_min", np.array(np.finfo(np.float32).min, dtype=np.float32)),
        initializer("score_scale", np.array(1.0 / np.sqrt(head_size), dtype=np.float32)),
        initializer("split_heads", np.array([0, 0, heads, head_size], dtype=np.int64)),
        initializer("merge_heads", np.array([0, 0, hidden], dtype=np.int64)),
        initializer("qkv_split", np.array([hidden, hidden, hidden], dtype=np.int64)),
        initializer("sqrt_half", np.array(np.sqrt(0.5), dtype=np.float32)),
        initializer("half", np.array(0.5, dtype=np.float32)),
    ]
    # Embeddings: words + (positions 0..L-1 + token type 0), then LayerNorm.
    nodes += [
        helper.make_node("Gather", ["word_embeddings", "input_ids"], ["words"], name="Words"),
        helper.make_node("Shape", ["input_ids"], ["ids_shape"], name="IdsShape"),
        helper.make_node("Gather", ["ids_shape", "one"], ["length"], name="Length", axis=0),
        helper.make_node(
            "Slice",
            ["position_and_type_embeddings", "zero", "length", "zero"],
            ["positions"],
            name="Positions",
        ),
        helper.make_node("Add", ["words", "positions"], ["embedded"], name="Embed"),
    ]
    _layer_norm(nodes, weights, tensors, "embeddings.LayerNorm", "embedded", "layer0_in", epsilon)
    # Additive mask [N,1,1,L]: 0 where attended, float32 min on padding.
    nodes += [
        helper.make_node("Cast", ["attention_mask"], ["mask_f"], name="MaskCast", to=1),
        helper.make_node("Sub", ["float_one", "mask_f"], ["mask_inv"], name="MaskInvert"),
        helper.make_node("Mul", ["mask_inv", "float_min"], ["mask_min"], name="MaskScale"),
        helper.make_node("Unsqueeze", ["mask_min", "mask_axes"], ["mask_bias"], name="MaskBias"),
    ]
    for index in range(layers):
        prefix, name, x = f"encoder.layer.{index}", f"layer{index}", f"layer{index}_in"
        attention = f"{prefix}.attention.self"
        qkv_w = np.concatenate(
            [tensors[f"{attention}.{part}.weight"] for part in ("query", "key", "value")]
        )
        qkv_b = np.concatenate(
            [tensors[f"{attention}.{part}.bias"] for part in ("query", "key", "value")]
        )
        weights += [
            initializer(f"{name}_qkv_wt", np.ascontiguousarray(qkv_w.T)),
            initializer(f"{name}_qkv_b", qkv_b),
        ]
        n = f"{name}_"
        nodes += [
            helper.make_node("MatMul", [x, f"{n}qkv_wt"], [f"{n}qkv_mm"], name=f"{n}QKV"),
            helper.make_node("Add", [f"{n}qkv_mm", f"{n}qkv_b"], [f"{n}qkv"], name=f"{n}QKVBias"),
            helper.make_node(
                "Split",
                [f"{n}qkv", "qkv_split"],
                [f"{n}q", f"{n}k", f"{n}v"],
                axis=2,
                name=f"{n}SplitQKV",
            ),
        ]
        for part, perm in (("q", [0, 2, 1, 3]), ("k", [0, 2, 3, 1]), ("v", [0, 2, 1, 3])):
            nodes += [
                helper.make_node(
                    "Reshape",
                    [f"{n}{part}", "split_heads"],
                    [f"{n}{part}_4d"],
                    name=f"{n}{part}Reshape",
                ),
                helper.make_node(
                    "Transpose",
                    [f"{n}{part}_4d"],
                    [f"{n}{part}_heads"],
                    perm=perm,
                    name=f"{n}{part}Transpose",
                ),
            ]
        nodes += [
            helper.make_node(
                "MatMul", [f"{n}q_heads", f"{n}k_heads"], [f"{n}scores_raw"], name=f"{n}Scores"
            ),
            helper.make_node(
                "Mul", [f"{n}scores_raw", "score_scale"], [f"{n}scores_scaled"], name=f"{n}Scale"
            ),
            helper.make_node(
                "Add", [f"{n}scores_scaled", "mask_bias"], [f"{n}scores"], name=f"{n}Mask"
            ),
            helper.make_node("Softmax", [f"{n}scores"], [f"{n}probs"], axis=-1, name=f"{n}Softmax"),
            helper.make_node(
                "MatMul", [f"{n}probs", f"{n}v_heads"], [f"{n}context_heads"], name=f"{n}Context"
            ),
            helper.make_node(
                "Transpose",
                [f"{n}context_heads"],
                [f"{n}context_4d"],
                perm=[0, 2, 1, 3],
                name=f"{n}ContextTranspose",
            ),
            helper.make_node(
                "Reshape",
                [f"{n}context_4d", "merge_heads"],
                [f"{n}context"],
                name=f"{n}ContextReshape",
            ),
        ]
        _linear(
            nodes,
            weights,
            tensors,
            f"{prefix}.attention.output.dense",
            f"{n}context",
            f"{n}attn_out",
        )
        nodes.append(
            helper.make_node("Add", [f"{n}attn_out", x], [f"{n}attn_res"], name=f"{n}AttnResidual")
        )
        _layer_norm(
            nodes,
            weights,
            tensors,
            f"{prefix}.attention.output.LayerNorm",
            f"{n}attn_res",
            f"{n}attn_norm",
            epsilon,
        )
        _linear(
            nodes, weights, tensors, f"{prefix}.intermediate.dense", f"{n}attn_norm", f"{n}inter"
        )
        # Exact GELU: 0.5 * x * (1 + erf(x / sqrt(2))); onnxruntime fuses it into one kernel.
        nodes += [
            helper.make_node("Mul", [f"{n}inter", "sqrt_half"], [f"{n}gelu_a"], name=f"{n}GeluA"),
            helper.make_node("Erf", [f"{n}gelu_a"], [f"{n}gelu_b"], name=f"{n}GeluErf"),
            helper.make_node("Add", [f"{n}gelu_b", "float_one"], [f"{n}gelu_c"], name=f"{n}GeluC"),
            helper.make_node("Mul", [f"{n}inter", f"{n}gelu_c"], [f"{n}gelu_d"], name=f"{n}GeluD"),
            helper.make_node("Mul", [f"{n}gelu_d", "half"], [f"{n}gelu"], name=f"{n}Gelu"),
        ]
        _linear(nodes, weights, tensors, f"{prefix}.output.dense", f"{n}gelu", f"{n}ffn_out")
        nodes.append(
            helper.make_node(
                "Add", [f"{n}ffn_out", f"{n}attn_norm"], [f"{n}ffn_res"], name=f"{n}FfnResidual"
            )
        )
        out = "last_hidden_state" if index == layers - 1 else f"layer{index + 1}_in"
        _layer_norm(
            nodes, weights, tensors, f"{prefix}.output.LayerNorm", f"{n}ffn_res", out, epsilon
        )
    graph = helper.make_graph(
        nodes,
        "minilm_transformer",
        [
            helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "sequence"]),
            helper.make_tensor_value_info(
                "attention_mask", TensorProto.INT64, ["batch", "sequence"]
            ),
        ],
        [
            helper.make_tensor_value_info(
                "last_hidden_state", TensorProto.FLOAT, ["batch", "sequence", hidden]
            )
        ],
        initializer=weights,
    )
    return finish(default_opset_model(graph), directory)
