"""Triton's ``auto_complete_config`` for Python models: the model fills in its own inputs,
outputs, batch size, batching and transaction policy, in a child process; its failures name
the model file and the reason."""

from __future__ import annotations

from pathlib import Path

import pytest

from sluice.core.repository import read_model

COMPLETING = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(auto_complete_model_config):
        auto_complete_model_config.add_input({"name": "X", "data_type": "TYPE_FP32", "dims": [3]})
        auto_complete_model_config.add_output({"name": "Y", "data_type": "TYPE_FP32", "dims": [3]})
        auto_complete_model_config.set_max_batch_size(8)
        auto_complete_model_config.set_dynamic_batching()
        return auto_complete_model_config

    def execute(self, requests):
        return [
            pb_utils.InferenceResponse(
                [pb_utils.Tensor("Y", pb_utils.get_input_tensor_by_name(r, "X").as_numpy() * 2)]
            )
            for r in requests
        ]
"""


def _model(root: Path, source: str, config: str = 'backend: "python"\n') -> Path:
    model = root / "completed"
    (model / "1").mkdir(parents=True)
    (model / "1" / "model.py").write_text(source)
    (model / "config.pbtxt").write_text(config)
    return model


def test_the_model_completes_its_configuration(tmp_path: Path) -> None:
    entry = read_model(_model(tmp_path, COMPLETING))
    assert entry.error is None, entry.error
    config = entry.config
    assert config is not None
    assert [(t.name, t.datatype, t.dims) for t in config.inputs] == [("X", "FP32", (3,))]
    assert [(t.name, t.datatype, t.dims) for t in config.outputs] == [("Y", "FP32", (3,))]
    assert config.max_batch_size == 8 and config.dynamic_batching is not None


@pytest.mark.slow
def test_what_the_configuration_says_wins_where_they_agree_and_conflicts_fail(
    tmp_path: Path,
) -> None:
    agreeing = (
        'backend: "python"\nmax_batch_size: 8\n'
        'input [ { name: "X" data_type: TYPE_FP32 dims: [ 3 ] } ]\n'
    )
    assert read_model(_model(tmp_path / "a", COMPLETING, agreeing)).error is None
    conflicting = 'backend: "python"\nmax_batch_size: 4\n'
    entry = read_model(_model(tmp_path / "b", COMPLETING, conflicting))
    assert entry.error is not None
    assert entry.error.startswith("model.py: auto_complete_config failed: ValueError: ")
    assert "set_max_batch_size(8): the configuration says 4" in entry.error


@pytest.mark.slow
def test_a_failing_or_broken_model_file_is_the_models_error(tmp_path: Path) -> None:
    raising = COMPLETING.replace(
        "auto_complete_model_config.set_max_batch_size(8)", "raise RuntimeError('no shapes')"
    )
    entry = read_model(_model(tmp_path / "a", raising))
    assert entry.error is not None and "RuntimeError: no shapes" in entry.error
    broken = read_model(_model(tmp_path / "b", "auto_complete_config = (\n"))
    assert broken.error is not None
    assert broken.error.startswith("model.py: auto_complete_config failed: ")
