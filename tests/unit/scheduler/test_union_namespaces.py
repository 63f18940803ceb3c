"""Several repositories joined with model namespacing (Triton's --model-namespacing=true):
a name several hold served from each under an internal name and listed as ambiguous, each
ensemble calling its own repository's model, poll mode seeing a change of what is held
twice as a change of every model, and the executor's catalog, loads and unloads following
the copies."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import cast

import pytest
from redis import Redis

from sluice.core.catalog import UNLOADED
from sluice.core.control import ControlCommand
from sluice.core.keys import Keys
from sluice.core.repository import RepositoryModel, scan_repository
from sluice.core.repository_namespaces import NAMESPACES_FILE, read_namespaces
from sluice.core.settings import RepositorySourceSettings
from sluice.scheduler.executor.model_control import ModelControl
from sluice.scheduler.executor.namespaced_commands import internal_named, on_each_copy
from sluice.scheduler.executor.start_loads import initially_loaded
from sluice.scheduler.executor.supervisor import Supervisor
from sluice.scheduler.repository.locations import open_source, snapshot_repository
from sluice.scheduler.repository.sources import poll
from sluice.scheduler.repository.union import UnionSource
from tests.support.onnx_models import write_identity

AMBIGUOUS = (
    "There are 2 identifiers of model '{}' in global map, model namespace must be provided "
    "to resolve ambiguity."
)


def _ensemble(repository: Path, name: str, step: str) -> None:
    (repository / name / "1").mkdir(parents=True)
    (repository / name / "config.pbtxt").write_text(
        f'name: "{name}"\nplatform: "ensemble"\nmax_batch_size: 8\n'
        'input [{ name: "X" data_type: TYPE_FP32 dims: [-1] }]\n'
        'output [{ name: "Y" data_type: TYPE_FP32 dims: [-1] }]\n'
        f'ensemble_scheduling {{ step [{{ model_name: "{step}" model_version: -1\n'
        '  input_map { key: "IN_FP32" value: "X" }\n'
        '  output_map { key: "OUT_FP32" value: "Y" } }] }\n'
    )


def _repositories(tmp_path: Path) -> list[Path]:
    """``first`` and ``second`` both hold ``comp`` and ``pipe`` (calling ``comp``);
    ``third`` holds an ensemble calling ``comp``, which it does not hold."""
    first, second, third = tmp_path / "first", tmp_path / "second", tmp_path / "third"
    for repository in (first, second):
        write_identity(repository, "comp", ["FP32"])
        _ensemble(repository, "pipe", "comp")
    write_identity(first, "alone", ["FP32"])
    _ensemble(third, "lost", "comp")
    _ensemble(third, "found", "alone")
    return [first, second, third]


def _settings(tmp_path: Path, namespacing: bool = True) -> RepositorySourceSettings:
    return RepositorySourceSettings(
        repository_cache_dir=str(tmp_path / "cache"), model_namespacing=namespacing
    )


def _scan(root: Path) -> dict[str, RepositoryModel]:
    return {model.name: model for model in scan_repository(root)}


def _step(model: RepositoryModel) -> str:
    """The model an ensemble's one step calls."""
    assert model.config is not None
    return model.config.ensemble_steps[0].model_name


def test_each_copy_is_served_and_each_ensemble_calls_its_own_repositorys(tmp_path: Path) -> None:
    repositories = _repositories(tmp_path)
    locations = [str(r) for r in repositories]
    root = snapshot_repository(locations, _settings(tmp_path))
    first, second, third = (r.resolve() for r in repositories)
    assert os.readlink(root / "comp@1") == str(first / "comp")
    assert os.readlink(root / "comp@2") == str(second / "comp")
    assert os.readlink(root / "alone") == str(first / "alone")
    assert not (root / "comp").exists()
    models = _scan(root)
    assert sorted(models) == [
        "alone",
        "comp",
        "comp@1",
        "comp@2",
        "found",
        "lost",
        "pipe",
        "pipe@1",
        "pipe@2",
    ]
    for name in ("comp", "pipe"):
        assert models[name].ambiguous and models[name].error == AMBIGUOUS.format(name)
    for copy in ("comp@1", "comp@2", "pipe@1", "pipe@2"):
        model = models[copy]
        assert model.usable, model.error
        assert model.config is not None and model.config.name == copy
        assert model.listed_as == copy.partition("@")[0]
    assert _step(models["pipe@1"]) == "comp@1" and _step(models["pipe@2"]) == "comp@2"
    assert models["found"].usable and models["alone"].listed_as == ""
    assert models["lost"].error == (
        f"ensemble {third}::lost contains models that are not available or ambiguous: comp"
    )


def test_without_a_name_held_twice_the_view_is_the_same_as_without_namespacing(
    tmp_path: Path,
) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    write_identity(first, "alpha", ["FP32"])
    write_identity(second, "beta", ["FP32"])
    locations = [str(first), str(second)]
    plain = open_source(locations, _settings(tmp_path, namespacing=False))
    spaced = open_source(locations, _settings(tmp_path))
    assert spaced.list() == plain.list()
    root = snapshot_repository(locations, _settings(tmp_path))
    assert [m.name for m in scan_repository(root) if m.usable] == ["alpha", "beta"]
    assert not any(m.listed_as or m.ambiguous for m in scan_repository(root))


def test_poll_mode_reloads_every_model_when_what_is_held_twice_changes(tmp_path: Path) -> None:
    repositories = _repositories(tmp_path)
    first, second, _ = repositories
    source = open_source([str(r) for r in repositories], _settings(tmp_path))
    assert isinstance(source, UnionSource)
    served, _ = poll(source, source.served())
    root = source.materialise(served).root

    shutil.rmtree(first / "comp")  # comp is now second's alone: every ensemble calls it
    listed, changes = poll(source, served)
    assert ("comp", 1) in changes.appeared
    assert {("comp@1", 1), ("comp@2", 1)} <= set(changes.disappeared)
    assert {("pipe@1", 1), ("pipe@2", 1), ("alone", 1), ("lost", 1)} <= set(changes.changed)
    source.materialise(listed)
    models = _scan(root)
    assert os.readlink(root / "comp") == str(second.resolve() / "comp")
    assert models["comp"].usable and models["lost"].usable
    assert _step(models["pipe@1"]) == "comp"

    write_identity(first, "comp", ["FP32"])  # held twice again
    listed, changes = poll(source, listed)
    source.materialise(listed)
    assert _scan(root)["comp"].ambiguous
    _, changes = poll(source, listed)
    assert not changes


def test_namespacing_turned_off_serves_a_name_held_twice_from_neither(tmp_path: Path) -> None:
    repositories = _repositories(tmp_path)
    locations = [str(r) for r in repositories]
    root = snapshot_repository(locations, _settings(tmp_path))
    assert read_namespaces(root) is not None
    assert snapshot_repository(locations, _settings(tmp_path, namespacing=False)) == root
    assert not (root / NAMESPACES_FILE).exists()
    assert not (root / "comp@1").exists()
    models = _scan(root)
    assert models["comp"].error == "model appears in two or more repositories"
    assert not models["comp"].ambiguous


def _control(root: Path, tmp_path: Path) -> ModelControl:
    return ModelControl(
        cast(Redis, None),
        Keys("namespaces-unit"),
        root,
        tmp_path / "staging",
        Supervisor([]),
        lambda *_: [],
        {},
        5.0,
        {},
        lambda: None,
    )


def test_the_executors_catalog_lists_each_copy_and_the_name_as_ambiguous(tmp_path: Path) -> None:
    root = snapshot_repository([str(r) for r in _repositories(tmp_path)], _settings(tmp_path))
    listed = {
        m.name: (m.error, m.listed_as, m.ambiguous) for m in _control(root, tmp_path).catalog()
    }
    assert listed["comp"] == (AMBIGUOUS.format("comp"), "", True)
    assert listed["comp@2"] == (UNLOADED, "comp", False)
    assert listed["alone"] == (UNLOADED, "", False)


def test_a_load_or_unload_of_a_name_held_twice_applies_to_each_copy(tmp_path: Path) -> None:
    root = snapshot_repository([str(r) for r in _repositories(tmp_path)], _settings(tmp_path))
    namespaces = read_namespaces(root)
    models = _scan(root)
    load = ControlCommand("load", "pipe", config='{"name": "pipe", "max_batch_size": 8}')
    parts = on_each_copy(load, namespaces, {}, models.get)
    assert [(p.op, p.model) for p in parts] == [
        ("load", "comp@1"),
        ("load", "pipe@1"),
        ("load", "comp@2"),
        ("load", "pipe@2"),
    ]
    assert [p.config for p in parts if p.model.startswith("pipe")] == ['{"max_batch_size": 8}'] * 2
    assert on_each_copy(ControlCommand("load", "alone"), namespaces, {}, models.get) == []
    loaded = {name: models[name] for name in ("comp@1", "comp@2", "pipe@1", "pipe@2")}
    unload = ControlCommand("unload", "pipe", dependents=True)
    parts = on_each_copy(unload, namespaces, loaded, models.get)
    assert [(p.op, p.model) for p in parts] == [
        ("unload", "pipe@1"),
        ("unload", "comp@1"),
        ("unload", "pipe@2"),
        ("unload", "comp@2"),
    ]
    # comp loaded while one repository held it: the copies replace it
    stale = {"comp": models["comp@1"]}
    parts = on_each_copy(ControlCommand("load", "comp"), namespaces, stale, models.get)
    assert [(p.op, p.model) for p in parts] == [
        ("load", "comp@1"),
        ("load", "comp@2"),
        ("unload", "comp"),
    ]
    assert internal_named(ControlCommand("load", "comp@1"), namespaces)
    assert not internal_named(ControlCommand("load", "comp@1", token=7), namespaces)
    assert not internal_named(ControlCommand("load", "comp"), namespaces)
    assert not internal_named(ControlCommand("load", "comp@1"), None)


def test_a_model_loaded_at_start_by_a_name_held_twice_is_each_copy(tmp_path: Path) -> None:
    root = snapshot_repository([str(r) for r in _repositories(tmp_path)], _settings(tmp_path))
    models = scan_repository(root)
    chosen = [m.name for m in initially_loaded(["pipe"], models, set())]
    assert chosen == ["comp@1", "comp@2", "pipe", "pipe@1", "pipe@2"]


def test_each_model_comes_with_its_repository_as_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Triton's namespace of a model is its repository's path as given (relative here),
    which its texts and metric labels show, and which it writes in each ensemble step's
    ``model_namespace`` (a field of its own: what a configuration sets there is not read)."""
    _repositories(tmp_path)
    (tmp_path / "second" / "pipe" / "config.pbtxt").write_text(
        (tmp_path / "second" / "pipe" / "config.pbtxt")
        .read_text()
        .replace("model_version: -1", 'model_version: -1 model_namespace: "third"')
    )
    monkeypatch.chdir(tmp_path)
    root = snapshot_repository(["first", "second", "third"], _settings(tmp_path))
    models = _scan(root)
    assert {name: models[name].namespace for name in ("alone", "comp@1", "comp@2", "found")} == {
        "alone": "first",
        "comp@1": "first",
        "comp@2": "second",
        "found": "third",
    }
    assert not models["comp"].namespace  # (a name held twice: no model of its own)
    steps: dict[str, list[tuple[str, str]]] = {}
    for name in ("pipe@1", "pipe@2", "found"):
        config = models[name].config
        assert config is not None
        steps[name] = [
            (step["model_name"], step["model_namespace"])
            for step in config.raw["ensemble_scheduling"]["step"]
        ]
    assert steps == {
        "pipe@1": [("comp@1", "first")],
        "pipe@2": [("comp@2", "second")],
        "found": [("alone", "first")],
    }
    assert models["lost"].error == (
        "ensemble third::lost contains models that are not available or ambiguous: comp"
    )


def test_the_executors_catalog_says_where_each_model_is_and_what_was_unloaded(
    tmp_path: Path,
) -> None:
    root = snapshot_repository([str(r) for r in _repositories(tmp_path)], _settings(tmp_path))
    models = _scan(root)
    control = _control(root, tmp_path)
    control.loaded["alone"] = (models["alone"], [])
    before = {m.name: m for m in control.catalog()}
    assert before["alone"].usable and before["alone"].namespace == str(tmp_path / "first")
    assert before["comp@2"].namespace == str(tmp_path / "second")
    assert not any(m.once_loaded for m in before.values())
    control._begin_unload(ControlCommand("unload", "alone"), deadline=0.0)
    after = {m.name: m for m in control.catalog()}
    assert (after["alone"].error, after["alone"].once_loaded) == (UNLOADED, True)
    assert after["alone"].namespace == str(tmp_path / "first")
    assert not after["found"].once_loaded
