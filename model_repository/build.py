"""Build the example models' files (``config.pbtxt`` and ``model.py`` files are committed).

Usage: ``python model_repository/build.py [--repository DIR] [--force]``

Every model is produced deterministically (fixed seeds, a deterministic solver),
so rebuilding gives the same weights. Models whose file exists are skipped
unless ``--force`` is given. The builders are importable for tests and the bench:
``build_iris(dir)``, ``build_mlp(dir)``, ``build_cnn(dir)`` each write
``<dir>/model.onnx`` and return its path; ``build_torchscript_mlp(dir)`` writes
``<dir>/model.pt`` and ``build_torch_export_mlp(dir)`` ``<dir>/model.pt2`` (both need
torch, and are skipped without it); ``build_all(repository)`` builds them all.
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


# --------------------------------------------------------------------------- repository

BUILDERS: dict[str, Callable[[Path | str], Path]] = {
    "iris": build_iris,
    "mlp": build_mlp,
    "cnn": build_cnn,
    "torchscript_mlp": build_torchscript_mlp,
    "torch_export_mlp": build_torch_export_mlp,
}
MODEL_FILES: dict[str, str] = {
    "torchscript_mlp": TORCHSCRIPT_FILE,
    "torch_export_mlp": TORCH_EXPORT_FILE,
}
"""The file each builder writes, where it is not model.onnx."""
TORCH_MODELS = frozenset({"torchscript_mlp", "torch_export_mlp"})
PYTHON_MODELS = ("text_stats", "triton_python_add_sub", "accumulator")
"""Models made of committed files only (config.pbtxt and <version>/model.py)."""
MODELS = (*BUILDERS, *PYTHON_MODELS)

COMMITTED_FILES = ("config.pbtxt", "labels.txt", "1/model.py")


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
    repository. Without torch the torch models are left out (with a note on stderr).
    """
    repository = Path(repository)
    wanted = MODELS if models is None else tuple(models)
    unknown = sorted(set(wanted) - set(MODELS))
    if unknown:
        raise ValueError(f"unknown example model(s): {', '.join(unknown)}")
    have_torch = not TORCH_MODELS.intersection(wanted) or torch_available()
    built: list[Path] = []
    for name in wanted:
        if name in TORCH_MODELS and not have_torch:
            print(
                f"skipping {name}: torch is not installed (pip install sluice[torch])",
                file=sys.stderr,
            )
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
