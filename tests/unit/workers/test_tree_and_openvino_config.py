"""Tree-model (FIL) and OpenVINO settings read from config.pbtxt, without the libraries."""

from __future__ import annotations

import numpy as np
import pytest

from sluice.core.config import parse_config_text
from sluice.core.errors import InvalidConfig, Unsupported
from sluice.core.placement import Placement
from sluice.workers.backends.openvino_backend import compile_properties
from sluice.workers.backends.tree_backend import TreeBackend, model_type


def _tree(parameters: str, *, inputs: str = "", outputs: str = "") -> str:
    inputs = inputs or '{ name: "input__0" data_type: TYPE_FP32 dims: [ 4 ] }'
    outputs = outputs or '{ name: "output__0" data_type: TYPE_FP32 dims: [ 3 ] }'
    return (
        'backend: "fil"\nmax_batch_size: 64\n'
        f"input [ {inputs} ]\noutput [ {outputs} ]\n{parameters}"
    )


def _param(key: str, value: str) -> str:
    return f'parameters {{ key: "{key}" value: {{ string_value: "{value}" }} }}\n'


def test_each_model_type_has_fil_s_default_file() -> None:
    for kind, filename in (
        ("xgboost_ubj", "xgboost.ubj"),
        ("xgboost_json", "xgboost.json"),
        ("xgboost", "xgboost.model"),
        ("lightgbm", "model.txt"),
        ("treelite_checkpoint", "checkpoint.tl"),
    ):
        config = parse_config_text(_tree(_param("model_type", kind)), model_name="t")
        assert config.default_model_filename == filename
        assert model_type(config) == kind


def test_a_missing_or_unknown_model_type_is_named() -> None:
    for parameters in ("", _param("model_type", "catboost")):
        config = parse_config_text(_tree(parameters), model_name="t")
        with pytest.raises(InvalidConfig, match="parameter 'model_type' must be one of"):
            model_type(config)


def _backend_error(text: str) -> str:
    config = parse_config_text(text, model_name="t")
    with pytest.raises((InvalidConfig, Unsupported)) as caught:
        TreeBackend(config, __import__("pathlib").Path("/nonexistent"), Placement())
    return str(caught.value)


def test_fil_s_tensors_and_threshold_are_checked_before_loading() -> None:
    kind = _param("model_type", "xgboost_ubj")
    renamed = '{ name: "features" data_type: TYPE_FP32 dims: [ 4 ] }'
    assert "takes one input, 'input__0'" in _backend_error(_tree(kind, inputs=renamed))
    shap = '{ name: "output__0" data_type: TYPE_FP32 dims: [ 3 ] }, ' + (
        '{ name: "treeshap_output" data_type: TYPE_FP32 dims: [ 5 ] }'
    )
    assert "SHAP outputs are not supported" in _backend_error(_tree(kind, outputs=shap))
    bad = kind + _param("output_class", "true") + _param("threshold", "1.5")
    assert "parameter 'threshold' must be a number from 0 to 1" in _backend_error(_tree(bad))
    light_on_gpu = _tree(_param("model_type", "lightgbm")).replace(
        "max_batch_size", "instance_group [ { kind: KIND_GPU } ]\nmax_batch_size"
    )
    config = parse_config_text(light_on_gpu, model_name="t")
    with pytest.raises(Unsupported, match="lightgbm models predict on the CPU"):
        TreeBackend(config, __import__("pathlib").Path("/x"), Placement("KIND_GPU", 0))


def test_fil_shapes_answers_as_triton_does() -> None:
    backend = TreeBackend.__new__(TreeBackend)
    backend._classifier, backend._proba, backend._threshold, backend._width = True, False, 0.3, 1
    binary = np.array([0.2, 0.31, 0.9], dtype=np.float32)
    assert backend._shape(binary).tolist() == [[0.0], [1.0], [1.0]]
    multi = np.array([[0.1, 0.7, 0.2], [0.5, 0.2, 0.3]], dtype=np.float32)
    assert backend._shape(multi).tolist() == [[1.0], [0.0]]
    backend._proba, backend._width = True, 2
    assert backend._shape(binary)[:, 1].tolist() == pytest.approx(binary.tolist())
    assert backend._shape(binary).shape == (3, 2)
    backend._width = 1
    assert backend._shape(binary).shape == (3, 1)
    backend._classifier = False
    assert backend._shape(binary).shape == (3, 1)


def test_openvino_properties_are_the_config_s_upper_case_parameters_over_defaults() -> None:
    text = (
        'backend: "openvino"\nmax_batch_size: 8\n'
        'input [ { name: "x" data_type: TYPE_FP32 dims: [ 2 ] } ]\n'
        'output [ { name: "y" data_type: TYPE_FP32 dims: [ 2 ] } ]\n'
        + _param("NUM_STREAMS", "2")
        + _param("SKIP_OV_DYNAMIC_BATCHSIZE", "YES")
        + _param("lowercase_note", "ignored")
    )
    config = parse_config_text(text, model_name="v")
    assert config.default_model_filename == "model.xml"
    properties = compile_properties(config, Placement(threads=3))
    assert properties == {
        "PERFORMANCE_HINT": "LATENCY",
        "INFERENCE_PRECISION_HINT": "f32",
        "INFERENCE_NUM_THREADS": "3",
        "NUM_STREAMS": "2",
    }
