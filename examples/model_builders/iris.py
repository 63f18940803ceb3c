"""The iris example: ``StandardScaler -> LogisticRegression`` converted by skl2onnx."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from examples.model_builders.onnx_files import OPSET, finish, initializer


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
    graph.initializer.append(initializer("label_axes", np.array([1], dtype=np.int64)))
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
    return finish(model, directory)
