"""Builds ``examples/more_backends/repository``: one small model for each backend beyond
ONNX, PyTorch and Python, made here from packages on the registries (nothing is downloaded
at run time), so that a TorchServe, TensorFlow, OpenVINO or tree-model user sees their
kind of model served:

- ``iris_xgboost`` (XGBoost UBJSON), ``iris_lightgbm`` (LightGBM text) and ``iris_forest``
  (a scikit-learn random forest as a Treelite checkpoint): ``backend: "fil"`` classifiers
  of scikit-learn's bundled iris data, answering each class's probability;
- ``mlp_openvino``: the example ``mlp`` converted to OpenVINO IR;
- ``affine_tensorflow``: a TensorFlow SavedModel, ``y = x·W + b``;
- ``shout``: a TorchServe archive made by ``torch-model-archiver`` whose handler answers a
  text in capitals (call it at ``/predictions/shout``).

Usage: ``python examples/more_backends/build.py [--repository DIR] [--force]``. Needs the
``trees``, ``openvino``, ``tensorflow`` and ``torchserve`` extras (all in ``dev``).
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
DEFAULT_REPOSITORY = HERE / "repository"
MODELS = (
    "iris_xgboost",
    "iris_lightgbm",
    "iris_forest",
    "mlp_openvino",
    "affine_tensorflow",
    "shout",
)

SHOUT_HANDLER = '''"""A TorchServe handler: each request's text, in capitals."""


def handle(data, context):
    if data is None:
        return None
    answers = []
    for request in data:
        text = request.get("data") or request.get("body") or ""
        if isinstance(text, (bytes, bytearray)):
            text = text.decode("utf-8", errors="replace")
        answers.append(str(text).upper())
    return answers
'''


def _fil_config(name: str, model_type: str) -> str:
    return (
        f'name: "{name}"\nbackend: "fil"\nmax_batch_size: 256\n'
        'input [ { name: "input__0" data_type: TYPE_FP32 dims: [ 4 ] } ]\n'
        'output [ { name: "output__0" data_type: TYPE_FP32 dims: [ 3 ] } ]\n'
        "instance_group [ { count: 1 kind: KIND_CPU } ]\n"
        "parameters [\n"
        f'  {{ key: "model_type" value: {{ string_value: "{model_type}" }} }},\n'
        '  { key: "output_class" value: { string_value: "true" } },\n'
        '  { key: "predict_proba" value: { string_value: "true" } }\n'
        "]\ndynamic_batching { max_queue_delay_microseconds: 500 }\n"
    )


def _folder(repository: Path, name: str, config: str) -> Path:
    version = repository / name / "1"
    version.mkdir(parents=True)
    (repository / name / "config.pbtxt").write_text(config)
    return version


def _iris() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_iris

    x, y = load_iris(return_X_y=True)
    return x.astype(np.float32), y


def build_trees(repository: Path) -> None:
    import lightgbm
    import treelite
    import treelite.sklearn
    import xgboost
    from sklearn.ensemble import RandomForestClassifier

    x, y = _iris()
    boosted = xgboost.XGBClassifier(n_estimators=20, max_depth=3, random_state=0, n_jobs=1)
    boosted.fit(x, y)
    version = _folder(repository, "iris_xgboost", _fil_config("iris_xgboost", "xgboost_ubj"))
    boosted.save_model(version / "xgboost.ubj")
    light = lightgbm.LGBMClassifier(
        n_estimators=20, num_leaves=8, random_state=0, n_jobs=1, verbose=-1
    )
    light.fit(x, y)
    version = _folder(repository, "iris_lightgbm", _fil_config("iris_lightgbm", "lightgbm"))
    light.booster_.save_model(str(version / "model.txt"))
    forest = RandomForestClassifier(n_estimators=15, max_depth=5, random_state=0, n_jobs=1)
    forest.fit(x, y)
    config = _fil_config("iris_forest", "treelite_checkpoint")
    version = _folder(repository, "iris_forest", config)
    treelite.sklearn.import_model(forest).serialize(str(version / "checkpoint.tl"))


def build_openvino(repository: Path) -> None:
    import openvino as ov

    spec = importlib.util.spec_from_file_location(
        "examples_build", ROOT / "model_repository" / "build.py"
    )
    assert spec is not None and spec.loader is not None
    builder = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(builder)
    with tempfile.TemporaryDirectory() as scratch:
        onnx_file = builder.build_mlp(Path(scratch))
        model = ov.convert_model(str(onnx_file))
        config = (
            'name: "mlp_openvino"\nbackend: "openvino"\nmax_batch_size: 256\n'
            'input [ { name: "input" data_type: TYPE_FP32 dims: [ 16 ] } ]\n'
            'output [ { name: "output" data_type: TYPE_FP32 dims: [ 4 ] } ]\n'
            "instance_group [ { count: 1 kind: KIND_CPU } ]\n"
            "dynamic_batching { max_queue_delay_microseconds: 200 }\n"
        )
        version = _folder(repository, "mlp_openvino", config)
        ov.save_model(model, str(version / "model.xml"), compress_to_fp16=False)


def build_tensorflow(repository: Path) -> None:
    import tensorflow as tf

    weights = (np.arange(8, dtype=np.float32).reshape(4, 2) / 10, np.array([0.5, -0.5], np.float32))

    class Affine(tf.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = tf.Variable(weights[0])
            self.b = tf.Variable(weights[1])

        @tf.function(input_signature=[tf.TensorSpec([None, 4], tf.float32, name="x")])
        def serve(self, x: tf.Tensor) -> dict[str, tf.Tensor]:
            return {"y": tf.matmul(x, self.w) + self.b}

    module = Affine()
    config = (
        'name: "affine_tensorflow"\nplatform: "tensorflow_savedmodel"\nmax_batch_size: 64\n'
        'input [ { name: "x" data_type: TYPE_FP32 dims: [ 4 ] } ]\n'
        'output [ { name: "y" data_type: TYPE_FP32 dims: [ 2 ] } ]\n'
        "instance_group [ { count: 1 kind: KIND_CPU } ]\n"
        "dynamic_batching { max_queue_delay_microseconds: 500 }\n"
    )
    version = _folder(repository, "affine_tensorflow", config)
    tf.saved_model.save(module, str(version / "model.savedmodel"), signatures=module.serve)


def build_torchserve(repository: Path) -> None:
    from sluice.core.torchserve.archives import triton_config

    with tempfile.TemporaryDirectory() as scratch:
        handler = Path(scratch) / "shout_handler.py"
        handler.write_text(SHOUT_HANDLER)
        archiver = Path(sys.executable).parent / "torch-model-archiver"
        subprocess.run(
            [
                str(archiver),
                "--model-name",
                "shout",
                "--version",
                "1.0",
                "--handler",
                str(handler),
                "--export-path",
                scratch,
                "--force",
            ],
            check=True,
            capture_output=True,
        )
        version = _folder(repository, "shout", triton_config("shout", 8, 20))
        shutil.move(str(Path(scratch) / "shout.mar"), version / "model.mar")


BUILDERS = (build_trees, build_openvino, build_tensorflow, build_torchserve)


def build_all(repository: Path = DEFAULT_REPOSITORY, *, force: bool = False) -> list[str]:
    """Build every example (all of them again with ``force``); returns their names."""
    if repository.exists():
        if not force and all((repository / name / "config.pbtxt").is_file() for name in MODELS):
            return list(MODELS)
        shutil.rmtree(repository)
    repository.mkdir(parents=True)
    for builder in BUILDERS:
        builder(repository)
    return list(MODELS)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repository", type=Path, default=DEFAULT_REPOSITORY)
    parser.add_argument("--force", action="store_true", help="build them all again")
    args = parser.parse_args()
    for name in build_all(args.repository, force=args.force):
        print(f"{args.repository / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
