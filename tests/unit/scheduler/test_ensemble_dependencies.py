"""An ensemble's composing models in explicit model control (:mod:`sluice.scheduler.executor.
dependencies`): which loads go before an ensemble's, which unloads after it with
``unload_dependents``, and how one client's command is answered once its group is done."""

from __future__ import annotations

from pathlib import Path

from sluice.core.config import parse_config_text
from sluice.core.control import ControlCommand
from sluice.core.repository import RepositoryModel, composing_models
from sluice.scheduler.executor.dependencies import Groups, loads_first, unloads_after

_MODEL = (
    'backend: "python" max_batch_size: 4 input [ { name: "X" data_type: TYPE_FP32 '
    'dims: [ 1 ] } ] output [ { name: "Y" data_type: TYPE_FP32 dims: [ 1 ] } ]'
)


def _ensemble(name: str, *steps: str) -> RepositoryModel:
    text = (
        f'name: "{name}" platform: "ensemble" max_batch_size: 4 '
        'input [ { name: "X" data_type: TYPE_FP32 dims: [ 1 ] } ] '
        'output [ { name: "Y" data_type: TYPE_FP32 dims: [ 1 ] } ] '
        "ensemble_scheduling { step [ "
    )
    tensors = ["X", *(f"t{i}" for i in range(len(steps) - 1)), "Y"]
    for index, step in enumerate(steps):
        text += "," if index else ""
        text += (
            f'{{ model_name: "{step}" model_version: -1 '
            f'input_map {{ key: "X" value: "{tensors[index]}" }} '
            f'output_map {{ key: "Y" value: "{tensors[index + 1]}" }} }} '
        )
    text += "] }"
    return RepositoryModel(name, Path(name), parse_config_text(text, model_name=name), (1,))


def _model(name: str) -> RepositoryModel:
    return RepositoryModel(name, Path(name), parse_config_text(_MODEL, model_name=name), (1,))


REPOSITORY = {
    "pipeline": _ensemble("pipeline", "pre", "inner", "post"),
    "inner": _ensemble("inner", "pre", "core"),
    "other": _ensemble("other", "post"),
    **{name: _model(name) for name in ("pre", "core", "post")},
}


def test_the_models_an_ensemble_calls_come_before_it_those_of_nested_ones_first() -> None:
    config = REPOSITORY["pipeline"].config
    assert config is not None
    assert composing_models(config, REPOSITORY.get) == ["pre", "core", "inner", "post"]
    assert composing_models(config, {"pre": _model("pre")}.get) == ["pre"]  # (others missing)


def test_a_load_of_an_ensemble_loads_what_it_calls_first() -> None:
    command = ControlCommand("load", "pipeline")
    parts = loads_first(command, REPOSITORY["pipeline"], {"core": 1}, REPOSITORY.get)
    assert [(p.op, p.model) for p in parts] == [
        ("load", "pre"),
        ("load", "inner"),
        ("load", "post"),
        ("load", "pipeline"),
    ]
    assert parts[-1].command_id != command.command_id
    loaded = dict.fromkeys(["pre", "core", "inner", "post"])
    assert loads_first(command, REPOSITORY["pipeline"], loaded, REPOSITORY.get) == []
    assert loads_first(ControlCommand("load", "pre"), REPOSITORY["pre"], {}, REPOSITORY.get) == []


def test_an_unload_with_dependents_keeps_what_another_loaded_model_calls() -> None:
    loaded = dict(REPOSITORY)
    command = ControlCommand("unload", "pipeline", dependents=True)
    parts = unloads_after(command, loaded)
    assert [(p.op, p.model, p.dependents) for p in parts] == [
        ("unload", "pipeline", False),
        ("unload", "pre", False),
        ("unload", "core", False),
        ("unload", "inner", False),
    ]  # ("post" stays: "other" calls it)
    assert unloads_after(ControlCommand("unload", "pipeline"), loaded) == []
    assert unloads_after(ControlCommand("unload", "pre", dependents=True), loaded) == []


def test_a_group_answers_once_all_are_done_or_at_the_first_failure() -> None:
    command = ControlCommand("load", "pipeline")
    groups = Groups()
    parts = loads_first(command, REPOSITORY["pipeline"], {}, REPOSITORY.get)
    groups.add(command, parts)
    queue = list(parts)
    first = queue.pop(0)
    assert groups.owns(first) and not groups.owns(command)
    assert groups.settle(first, None, queue) is None
    second = queue.pop(0)
    settled = groups.settle(second, "failed to load 'core', no such file", queue)
    assert settled == (command, "failed to load 'pipeline', failed to load 'core', no such file")
    assert queue == [] and not any(groups.owns(p) for p in parts)
    # The ensemble's own failure is the answer as it is; success once every part is done.
    again = Groups()
    again.add(command, parts[-1:])
    assert again.settle(parts[-1], "failed to load 'pipeline', bad", []) == (
        command,
        "failed to load 'pipeline', bad",
    )
    done = Groups()
    done.add(command, parts[-1:])
    assert done.settle(parts[-1], None, []) == (command, None)
