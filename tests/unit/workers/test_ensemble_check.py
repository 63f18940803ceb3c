"""An ensemble's load refuses tensors its models declare differently (Triton core
``ValidateTensorConsistency``): before, such an ensemble loaded, and a step got its input
cast to the type it declares (FP32 truncated to INT32) or a shape it could not take."""

from __future__ import annotations

from pathlib import Path

import pytest

from sluice.core.config import parse_config_text
from sluice.core.errors import InvalidConfig
from sluice.workers.backends.ensemble_check import composing_configs


def _model(root: Path, name: str, inputs: str, outputs: str, batch: int = 8) -> None:
    (root / name / "1").mkdir(parents=True)
    (root / name / "1" / "model.py").write_text("class Model: ...\n")
    (root / name / "config.pbtxt").write_text(
        f'name: "{name}" backend: "python" max_batch_size: {batch} '
        f"input [ {inputs} ] output [ {outputs} ]"
    )


def _tensor(name: str, datatype: str, dims: str) -> str:
    return f'{{ name: "{name}" data_type: TYPE_{datatype} dims: [ {dims} ] }}'


def _ensemble(output_type: str = "FP32", output_dims: str = "3") -> str:
    return f"""
    name: "chain" platform: "ensemble" max_batch_size: 8
    input [ {_tensor("IN", "FP32", "3")} ]
    output [ {_tensor("OUT", output_type, output_dims)} ]
    ensemble_scheduling {{ step [
      {{ model_name: "first" model_version: -1 input_map {{ key: "X" value: "IN" }}
        output_map {{ key: "Y" value: "mid" }} }},
      {{ model_name: "second" model_version: -1 input_map {{ key: "X" value: "mid" }}
        output_map {{ key: "Y" value: "OUT" }} }}
    ] }}
    """


def _check(root: Path, ensemble: str) -> None:
    composing_configs(parse_config_text(ensemble, model_name="chain"), root)


def test_a_tensor_of_two_data_types_fails_the_load(tmp_path: Path) -> None:
    _model(tmp_path, "first", _tensor("X", "FP32", "3"), _tensor("Y", "FP32", "3"))
    _model(tmp_path, "second", _tensor("X", "INT32", "3"), _tensor("Y", "FP32", "3"))
    with pytest.raises(InvalidConfig) as info:
        _check(tmp_path, _ensemble())
    assert info.value.message == (
        "in ensemble chain, ensemble tensor mid: inconsistent data type: TYPE_FP32 is inferred "
        "from model first while TYPE_INT32 is inferred from model second"
    )


def test_a_tensor_of_two_shapes_fails_the_load(tmp_path: Path) -> None:
    _model(tmp_path, "first", _tensor("X", "FP32", "3"), _tensor("Y", "FP32", "4"))
    _model(tmp_path, "second", _tensor("X", "FP32", "3"), _tensor("Y", "FP32", "3"))
    with pytest.raises(InvalidConfig) as info:
        _check(tmp_path, _ensemble())
    assert info.value.message == (
        "in ensemble chain, ensemble tensor mid: inconsistent shape: [-1,4] is inferred "
        "from model first while [-1,3] is inferred from model second"
    )


def test_the_ensembles_own_inputs_and_outputs_count(tmp_path: Path) -> None:
    _model(tmp_path, "first", _tensor("X", "FP32", "3"), _tensor("Y", "FP32", "3"))
    _model(tmp_path, "second", _tensor("X", "FP32", "3"), _tensor("Y", "FP32", "3"))
    _check(tmp_path, _ensemble())
    with pytest.raises(InvalidConfig, match="tensor OUT: inconsistent data type: TYPE_STRING"):
        _check(tmp_path, _ensemble(output_type="STRING"))
    with pytest.raises(InvalidConfig, match=r"tensor OUT: inconsistent shape: \[-1,2\]"):
        _check(tmp_path, _ensemble(output_dims="2"))


def test_variable_dims_and_a_batch_dimension_of_its_own_are_compatible(tmp_path: Path) -> None:
    """-1 matches any size; a non-batching model's [-1, 3] is a batching model's [3]."""
    _model(tmp_path, "first", _tensor("X", "FP32", "-1"), _tensor("Y", "FP32", "-1, 3"), 0)
    _model(tmp_path, "second", _tensor("X", "FP32", "3"), _tensor("Y", "FP32", "-1"))
    _check(tmp_path, _ensemble())
