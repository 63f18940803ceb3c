"""What every ONNX builder shares: the opset, the IR version and the checked write."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17
IR_VERSION = 9
MODEL_FILE = "model.onnx"


def finish(model: onnx.ModelProto, directory: Path | str) -> Path:
    """Pin the IR version, check the model and write it to ``<directory>/model.onnx``."""
    model.ir_version = IR_VERSION
    model.producer_name = "sluice-model-repository"
    model.producer_version = "1"
    onnx.checker.check_model(model, full_check=True)
    path = Path(directory) / MODEL_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(model.SerializeToString())
    return path


def initializer(name: str, array: np.ndarray) -> TensorProto:
    return numpy_helper.from_array(array, name=name)


def default_opset_model(graph: onnx.GraphProto) -> onnx.ModelProto:
    """A model of ``graph`` on the default domain at :data:`OPSET`."""
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
