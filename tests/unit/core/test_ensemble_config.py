"""Ensemble configurations: parsed into typed steps, each of Triton's static errors named
with its field and reason, and the steps' order (waves of steps that may run together)."""

from __future__ import annotations

from pathlib import Path

import pytest

from sluice.core.config import CycleError, EnsembleStep, FrozenMap, parse_config_text, step_levels
from sluice.core.errors import InvalidConfig
from sluice.core.repository import read_model

_TENSORS = """
input [ { name: "IN" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 4 ] } ]
"""


def _step(model: str, inputs: dict[str, str], outputs: dict[str, str], version: int = -1) -> str:
    def entries(field: str, mapping: dict[str, str]) -> str:
        return " ".join(f'{field} {{ key: "{k}" value: "{v}" }}' for k, v in mapping.items())

    return (
        f'{{ model_name: "{model}" model_version: {version} '
        f"{entries('input_map', inputs)} {entries('output_map', outputs)} }}"
    )


def _ensemble(*steps: str, tensors: str = _TENSORS, name: str = "pipe") -> str:
    return (
        f'name: "{name}"\nplatform: "ensemble"\nmax_batch_size: 8\n{tensors}\n'
        f"ensemble_scheduling {{ step [ {', '.join(steps)} ] }}\n"
    )


def _parse(text: str) -> None:
    parse_config_text(text, model_name="pipe")


def test_steps_are_parsed_into_typed_frozen_dataclasses() -> None:
    config = parse_config_text(
        _ensemble(
            _step("pre", {"RAW": "IN"}, {"FEAT": "mid"}, version=2),
            _step("post", {"X": "mid"}, {"Y": "OUT"}),
        ),
        model_name="pipe",
    )
    assert config.is_ensemble
    assert config.ensemble_steps == (
        EnsembleStep("pre", 2, FrozenMap({"RAW": "IN"}), FrozenMap({"FEAT": "mid"})),
        EnsembleStep("post", -1, FrozenMap({"X": "mid"}), FrozenMap({"Y": "OUT"})),
    )
    assert config.raw["ensemble_scheduling"]["step"][0]["model_name"] == "pre"
    hash(config)  # frozen all the way down


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            'name: "pipe"\nplatform: "ensemble"\n' + _TENSORS,
            "ensemble_scheduling: must be set for a model whose platform is 'ensemble'",
        ),
        (
            'name: "pipe"\nplatform: "ensemble"\n' + _TENSORS + "ensemble_scheduling { }",
            "ensemble_scheduling: must have at least one step",
        ),
        (
            'name: "pipe"\nbackend: "python"\n' + _TENSORS + "ensemble_scheduling { }",
            "ensemble_scheduling: may only be set for a model whose platform is 'ensemble'",
        ),
        (
            _ensemble(_step("", {"a": "IN"}, {"b": "OUT"})),
            "ensemble_scheduling.step[0]: model_name must be set",
        ),
        (
            _ensemble(_step("pipe", {"a": "IN"}, {"b": "OUT"})),
            "step[0]: model_name 'pipe' is the ensemble itself (circular dependency)",
        ),
        (
            _ensemble(_step("m", {"a": "IN"}, {"b": "OUT"}, version=0)),
            "step[0] (model 'm'): model_version must be -1 (the latest version) or a version",
        ),
        (
            _ensemble(_step("m", {}, {"b": "OUT"})),
            "step[0] (model 'm'): input_map must not be empty",
        ),
        (
            _ensemble(_step("m", {"a": "IN"}, {})),
            "step[0] (model 'm'): output_map must not be empty",
        ),
        (
            _ensemble(_step("m", {"a": "IN"}, {"b": "OUT"}), _step("n", {"a": "IN"}, {"c": "OUT"})),
            "step[1] (model 'n'): ensemble tensor 'OUT' can appear in an output map only once",
        ),
        (
            _ensemble(_step("m", {"a": "IN"}, {"b": "OUT", "c": "IN"})),
            "step[0] (model 'm'): ensemble tensor 'IN' is an input of ensemble 'pipe'",
        ),
        (
            _ensemble(_step("m", {"a": "IN", "z": "nowhere"}, {"b": "OUT"})),
            "ensemble tensor 'nowhere' is neither an input of ensemble 'pipe' nor written",
        ),
        (
            _ensemble(
                _step("m", {"a": "IN"}, {"b": "OUT"}),
                tensors=_TENSORS + 'input [ { name: "EXTRA" data_type: TYPE_FP32 dims: [ 1 ] } ]',
            ),
            "input 'EXTRA' for ensemble 'pipe' is not used",
        ),
        (
            _ensemble(_step("m", {"a": "IN"}, {"b": "other"})),
            "output 'OUT' for ensemble 'pipe' is not written",
        ),
        (
            _ensemble(
                _step("m", {"a": "IN", "x": "loop_b"}, {"b": "loop_a"}),
                _step("n", {"a": "loop_a"}, {"b": "loop_b", "c": "OUT"}),
            ),
            "ensemble_scheduling: the steps step[0] (model 'm'), step[1] (model 'n') depend "
            "on each other (a cycle)",
        ),
    ],
)
def test_each_static_error_names_its_field(text: str, expected: str) -> None:
    with pytest.raises(InvalidConfig) as caught:
        _parse(text)
    assert expected in caught.value.message
    assert caught.value.message.startswith("config.pbtxt: ")


def test_step_levels_run_independent_branches_together() -> None:
    config = parse_config_text(
        _ensemble(
            _step("join", {"l": "left", "r": "right"}, {"y": "OUT"}),
            _step("left", {"x": "IN"}, {"y": "left"}),
            _step("right", {"x": "IN"}, {"y": "right"}),
        ),
        model_name="pipe",
    )
    assert step_levels(config.ensemble_steps, {"IN"}) == [[1, 2], [0]]


def test_step_levels_refuse_a_cycle() -> None:
    steps = (
        EnsembleStep("a", -1, FrozenMap({"x": "t2"}), FrozenMap({"y": "t1"})),
        EnsembleStep("b", -1, FrozenMap({"x": "t1"}), FrozenMap({"y": "t2"})),
    )
    with pytest.raises(CycleError):
        step_levels(steps, {"IN"})


def test_an_ensemble_version_folder_needs_no_model_file(tmp_path: Path) -> None:
    (tmp_path / "pipe" / "1").mkdir(parents=True)
    (tmp_path / "pipe" / "config.pbtxt").write_text(
        _ensemble(_step("m", {"a": "IN"}, {"b": "OUT"}))
    )
    model = read_model(tmp_path / "pipe")
    assert model.error is None and model.versions == (1,)
