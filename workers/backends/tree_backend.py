"""Tree models (``backend: "fil"``): XGBoost, LightGBM and Treelite checkpoints (which is how
scikit-learn forests travel), configured as for Triton's FIL backend, run on the CPU by
the libraries made for them.

Triton's FIL backend reads its options from ``parameters``: ``model_type`` (the file
format: ``xgboost_ubj``, ``xgboost_json``, ``xgboost``, ``lightgbm``,
``treelite_checkpoint``; each with its default file name), ``output_class`` (a classifier),
``predict_proba`` (class probabilities instead of the class), ``threshold`` (a binary
classifier's decision threshold, 0.5 by default). The input is ``input__0``, FP32
``[features]``; the output ``output__0``, FP32: the prediction (regressor), the class
index (classifier), or the probability of each class (``predict_proba``; a binary model's
output is ``[1]``, the positive class's probability, or ``[2]``, both, as its config says).
GPU-only FIL options (``threads_per_tree``, ``storage_type``, ``algo``, ``blocks_per_sm``,
``transfer_threshold``) do not change answers and are accepted and ignored on the CPU.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np

from sluice.core.config import ModelConfig
from sluice.core.config.platforms import tree_formats
from sluice.core.errors import InvalidConfig, Unsupported
from sluice.core.placement import Placement
from sluice.workers.backends.base import missing_extra
from sluice.workers.backends.threads import flag_parameter, threads_or_all

INPUT = "input__0"
OUTPUT = "output__0"

_PACKAGES = {
    "xgboost_ubj": "xgboost",
    "xgboost_json": "xgboost",
    "xgboost": "xgboost",
    "lightgbm": "lightgbm",
    "treelite_checkpoint": "treelite",
}

Predict = Callable[[np.ndarray], np.ndarray]
"""Rows (float32, [n, features]) -> the model's transformed output: [n] or [n, classes]."""


def model_type(config: ModelConfig) -> str:
    value = config.parameters.get("model_type", "").strip()
    if value not in tree_formats():
        raise InvalidConfig(
            f"model '{config.name}': parameter 'model_type' must be one of "
            f"{', '.join(tree_formats())}, got {value!r}"
        )
    return value


def _threshold(config: ModelConfig) -> float:
    raw = config.parameters.get("threshold")
    if raw is None:
        return 0.5
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not 0.0 <= value <= 1.0:
        raise InvalidConfig(
            f"model '{config.name}': parameter 'threshold' must be a number from 0 to 1, "
            f"got {raw!r}"
        )
    return value


def _check_tensors(config: ModelConfig) -> int:
    """The feature count the config declares; FIL's tensor names and types are required."""
    if [t.name for t in config.inputs] != [INPUT] or config.inputs[0].datatype != "FP32":
        raise InvalidConfig(
            f"model '{config.name}': a tree model takes one input, '{INPUT}' (TYPE_FP32, "
            "[ features ])"
        )
    if [t.name for t in config.outputs] != [OUTPUT] or config.outputs[0].datatype != "FP32":
        raise Unsupported(
            f"model '{config.name}': a tree model has one output, '{OUTPUT}' (TYPE_FP32); "
            "SHAP outputs are not supported"
        )
    dims = config.inputs[0].dims
    if len(dims) != 1 or dims[0] < 1:
        raise InvalidConfig(
            f"model '{config.name}': input '{INPUT}' must have dims [ features ], got {list(dims)}"
        )
    return int(dims[0])


def _load(kind: str, path: Path, threads: int, gpu: int | None) -> tuple[Predict, int]:
    """The model's prediction function and its feature count; ``gpu``: the device of a
    KIND_GPU instance (XGBoost only: the other libraries predict on the CPU)."""
    if gpu is not None and not kind.startswith("xgboost"):
        raise Unsupported(
            f"{kind} models predict on the CPU here; use instance_group kind KIND_CPU "
            "(XGBoost models can use a GPU)"
        )
    if kind.startswith("xgboost"):
        import xgboost

        booster = xgboost.Booster(model_file=str(path))
        booster.set_param({"nthread": threads})
        if gpu is not None:
            if not xgboost.build_info().get("USE_CUDA"):
                raise Unsupported(
                    "this XGBoost was built without CUDA; install the 'gpu' extra's xgboost "
                    "on a machine with an NVIDIA GPU, or use KIND_CPU"
                )
            booster.set_param({"device": f"cuda:{gpu}"})
        return (lambda rows: booster.inplace_predict(rows)), booster.num_features()
    if kind == "lightgbm":
        import lightgbm

        model = lightgbm.Booster(model_file=str(path))

        def predict_light(rows: np.ndarray) -> np.ndarray:
            return np.asarray(model.predict(rows, num_threads=threads))

        return predict_light, model.num_feature()
    import treelite

    forest = treelite.Model.deserialize(str(path))

    def predict(rows: np.ndarray) -> np.ndarray:
        # GTIL answers [rows, targets, classes]; FIL serves single-target models.
        out = np.asarray(treelite.gtil.predict(forest, rows, nthread=threads))
        return out.reshape(out.shape[0], -1)

    return predict, int(forest.num_feature)


class TreeBackend:
    computes_inline = True
    """It never calls back into the worker's event loop: a short batch may compute on the
    loop itself (:data:`sluice.workers.execution.INLINE_MAX_S`)."""

    def __init__(self, config: ModelConfig, model_path: Path, placement: Placement) -> None:
        name = config.name
        kind = model_type(config)
        features = _check_tensors(config)
        self._classifier = bool(flag_parameter(name, config.parameters, "output_class"))
        self._proba = bool(flag_parameter(name, config.parameters, "predict_proba"))
        self._threshold = _threshold(config)
        out_dims = config.outputs[0].dims
        self._width = int(out_dims[-1]) if out_dims else 1
        try:
            gpu = (placement.gpu or 0) if placement.kind == "KIND_GPU" else None
            self._predict, model_features = _load(
                kind, model_path, threads_or_all(placement.threads), gpu
            )
        except ImportError:
            raise missing_extra(name, _PACKAGES[kind], "trees") from None
        except (InvalidConfig, Unsupported):
            raise
        except Exception as exc:
            raise InvalidConfig(f"cannot load {model_path.name} as {kind}: {exc}") from None
        if model_features != features:
            raise InvalidConfig(
                f"model '{name}': {model_path.name} takes {model_features} features, "
                f"the config's '{INPUT}' declares {features}"
            )

    def infer(
        self,
        inputs: Mapping[str, np.ndarray],
        outputs: Sequence[str],
        request_sizes: Sequence[int] | None = None,
    ) -> dict[str, np.ndarray]:
        rows = np.ascontiguousarray(inputs[INPUT], dtype=np.float32)
        raw = np.asarray(self._predict(rows), dtype=np.float32)
        if raw.ndim == 2 and raw.shape[1] == 1:
            raw = raw[:, 0]
        return {OUTPUT: self._shape(raw)}

    def _shape(self, raw: np.ndarray) -> np.ndarray:
        """FIL's answer from the model's: value, class index or class probabilities."""
        if not self._classifier:
            return raw.reshape(len(raw), -1)
        binary = raw.ndim == 1
        if self._proba:
            if binary and self._width == 2:
                return np.stack([1.0 - raw, raw], axis=1)
            return raw.reshape(len(raw), -1)
        if binary:
            labels = (raw > self._threshold).astype(np.float32)
        else:
            labels = raw.argmax(axis=1).astype(np.float32)
        return labels.reshape(-1, 1)

    def close(self) -> None:
        self._predict = _closed


def _closed(rows: np.ndarray) -> np.ndarray:
    raise RuntimeError("the model is closed")
