"""The example model repository: each model builds, loads in onnxruntime and fits its config."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import numpy as np
import onnxruntime as ort
import pytest

from sluice.core.config import ModelConfig, parse_config_text

REPOSITORY = Path(__file__).resolve().parents[3] / "model_repository"


def _load_build_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("model_repository_build", REPOSITORY / "build.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


build = _load_build_module()


def _session(path: Path) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def _config(model: str) -> ModelConfig:
    text = (REPOSITORY / model / "config.pbtxt").read_text()
    return parse_config_text(text, model_name=model)


def _config_dims(config: ModelConfig) -> dict[str, list[int]]:
    """name -> dims of every input and output."""
    return {tensor.name: list(tensor.dims) for tensor in [*config.inputs, *config.outputs]}


@pytest.mark.parametrize(
    ("model", "builder"),
    [
        pytest.param("iris", "build_iris", marks=pytest.mark.slow),
        ("mlp", "build_mlp"),
        ("cnn", "build_cnn"),
    ],
)
def test_model_matches_config(tmp_path: Path, model: str, builder: str) -> None:
    path = getattr(build, builder)(tmp_path)
    assert path == tmp_path / "model.onnx"
    session = _session(path)
    config = _config(model)
    assert config.name == model
    assert config.platform == "onnxruntime_onnx"
    dims = _config_dims(config)
    [model_input] = session.get_inputs()
    assert model_input.type == "tensor(float)"
    batch = 3
    assert batch <= config.max_batch_size
    data = np.random.default_rng(0).standard_normal([batch, *dims[model_input.name]])
    outputs = session.run(None, {model_input.name: data.astype(np.float32)})
    names = [output.name for output in session.get_outputs()]
    assert set(names) == set(dims) - {model_input.name}
    for name, value in zip(names, outputs, strict=True):
        assert list(value.shape) == [batch, *dims[name]], name
        assert np.all(np.isfinite(value)), name


@pytest.mark.slow
def test_iris_classifier_is_accurate(tmp_path: Path) -> None:
    from sklearn.datasets import load_iris

    session = _session(build.build_iris(tmp_path))
    features, target = load_iris(return_X_y=True)
    label, probabilities = session.run(
        ["label", "probabilities"], {"input": features.astype(np.float32)}
    )
    assert label.dtype == np.int64 and label.shape == (len(target), 1)
    assert probabilities.dtype == np.float32 and probabilities.shape == (len(target), 3)
    np.testing.assert_allclose(probabilities.sum(axis=1), 1.0, rtol=1e-5)
    assert np.mean(label[:, 0] == target) > 0.9
    np.testing.assert_array_equal(label[:, 0], probabilities.argmax(axis=1))
    labels = (REPOSITORY / "iris" / "labels.txt").read_text().split()
    assert labels == ["setosa", "versicolor", "virginica"]


@pytest.mark.slow
def test_build_all_is_idempotent(tmp_path: Path) -> None:
    pytest.importorskip("skl2onnx")
    built = build.build_all(tmp_path)
    torch_models = ["torch_export_mlp", "torchscript_mlp"] if build.torch_available() else []
    minilm = sorted(build.MINILM_MODELS) if build.minilm_source() is not None else []
    names = sorted(path.parent.parent.name for path in built)
    assert names == sorted(["cnn", "iris", "mlp", *torch_models, *minilm])
    for name in ("iris", "mlp", "cnn", "text_stats", "triton_python_add_sub", *torch_models):
        assert (tmp_path / name / "config.pbtxt").is_file()
    assert (tmp_path / "iris" / "labels.txt").is_file()
    for name in build.PYTHON_MODELS:
        assert (tmp_path / name / "1" / "model.py").is_file()
    first = {path: path.read_bytes() for path in built}
    assert build.build_all(tmp_path) == []
    rebuilt = build.build_all(tmp_path, force=True)
    assert sorted(rebuilt) == sorted(built)
    # TorchScript renames a class traced twice in one process, so model.pt is byte-identical
    # across runs of build.py but not within one process; everything else is.
    assert {path: path.read_bytes() for path in rebuilt if path.suffix != ".pt"} == {
        path: data for path, data in first.items() if path.suffix != ".pt"
    }


def test_build_all_builds_only_the_models_named(tmp_path: Path) -> None:
    built = build.build_all(tmp_path, models=["mlp", "text_stats"])
    assert built == [tmp_path / "mlp" / "1" / "model.onnx"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mlp", "text_stats"]
    with pytest.raises(ValueError, match="unknown example model"):
        build.build_all(tmp_path, models=["nope"])
