"""Several repositories joined in one view (Triton's --model-repository given more than
once): each model served from where it is, a name held twice served from neither, the view
following the repositories as they change, and nothing in the view Sluice did not put
there."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import cast

import pytest
from redis import Redis

from sluice.core.catalog import UNLOADED
from sluice.core.keys import Keys
from sluice.core.repository import DUPLICATE_REASON, DUPLICATES_FILE, scan_repository
from sluice.core.settings import (
    BatchStoreSettings,
    ControllerSettings,
    RepositorySourceSettings,
    UpSettings,
    locations_text,
)
from sluice.scheduler.executor.model_control import ModelControl
from sluice.scheduler.executor.supervisor import Supervisor
from sluice.scheduler.repository.locations import open_source, snapshot_repository
from sluice.scheduler.repository.sources import SourceError, poll
from sluice.scheduler.repository.union import UnionSource, view_folder
from tests.support.onnx_models import write_identity


def _settings(tmp_path: Path) -> RepositorySourceSettings:
    return RepositorySourceSettings(repository_cache_dir=str(tmp_path / "cache"))


def _repositories(tmp_path: Path) -> tuple[Path, Path]:
    first, second = tmp_path / "first", tmp_path / "second"
    write_identity(first, "alpha", ["FP32"])
    write_identity(first, "shared", ["FP32"])
    write_identity(second, "beta", ["FP32"])
    write_identity(second, "shared", ["INT32"])
    return first, second


def test_two_repositories_are_served_as_one_and_a_shared_name_from_neither(
    tmp_path: Path,
) -> None:
    first, second = _repositories(tmp_path)
    settings = _settings(tmp_path)
    root = snapshot_repository([str(first), str(second)], settings)
    assert root == view_folder(settings.repository_cache_dir, [str(first), str(second)])
    assert os.readlink(root / "alpha") == str(first.resolve() / "alpha")
    assert os.readlink(root / "beta") == str(second.resolve() / "beta")
    assert not (root / "shared").exists()
    models = {model.name: model for model in scan_repository(root)}
    assert sorted(models) == ["alpha", "beta", "shared"]
    assert models["alpha"].usable and models["beta"].usable
    assert models["shared"].error == DUPLICATE_REASON == "model appears in two or more repositories"
    assert not models["shared"].usable
    # One location is served in place, as before.
    assert snapshot_repository([str(first)], settings) == first.resolve()


def test_the_view_follows_the_repositories(tmp_path: Path) -> None:
    first, second = _repositories(tmp_path)
    source = open_source([str(first), str(second)], _settings(tmp_path))
    assert isinstance(source, UnionSource)
    served, _ = poll(source, source.served())
    root = source.materialise(served).root

    shutil.rmtree(second / "shared")  # no longer held twice: served from the first
    write_identity(second, "gamma", ["FP32"])  # a new model in the second
    shutil.rmtree(first / "alpha")  # gone
    listed, changes = poll(source, served)
    assert ("gamma", 1) in changes.appeared and ("alpha", 1) in changes.disappeared
    assert ("shared", 1) in changes.appeared
    source.materialise(listed)
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) == [
        "beta",
        "gamma",
        "shared",
    ]
    assert os.readlink(root / "shared") == str(first.resolve() / "shared")
    assert all(model.usable for model in scan_repository(root))

    write_identity(second, "beta2", ["FP32"])
    os.rename(second / "beta2", first / "beta")  # now held twice again
    listed, changes = poll(source, listed)
    assert ("beta", 1) in changes.disappeared
    source.materialise(listed)
    assert not (root / "beta").exists()
    assert [m.name for m in scan_repository(root) if m.error] == ["beta"]


def test_an_ensemble_reads_a_composing_model_of_another_repository(tmp_path: Path) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    write_identity(second, "step", ["FP32"])
    (first / "pipeline" / "1").mkdir(parents=True)
    (first / "pipeline" / "config.pbtxt").write_text(
        'name: "pipeline"\nplatform: "ensemble"\nmax_batch_size: 8\n'
        'input [{ name: "INPUT0" data_type: TYPE_FP32 dims: [-1] }]\n'
        'output [{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [-1] }]\n'
        'ensemble_scheduling { step [{ model_name: "step" model_version: -1\n'
        '  input_map { key: "INPUT0" value: "INPUT0" }\n'
        '  output_map { key: "OUTPUT0" value: "OUTPUT0" } }] }\n'
    )
    root = snapshot_repository([str(first), str(second)], _settings(tmp_path))
    models = {model.name: model for model in scan_repository(root)}
    assert models["pipeline"].usable, models["pipeline"].error
    assert (models["pipeline"].path.parent / "step" / "config.pbtxt").is_file()


def test_the_executors_catalog_shows_a_shared_name_as_unavailable(tmp_path: Path) -> None:
    """In explicit and poll mode the executor publishes what it loaded and the rest of the
    repository as unloaded; a name two repositories hold is not a folder of the view, and
    is listed with Triton's reason all the same, as Triton's index lists it in every mode."""
    first, second = _repositories(tmp_path)
    root = snapshot_repository([str(first), str(second)], _settings(tmp_path))
    control = ModelControl(
        cast(Redis, None),
        Keys("view-unit"),
        root,
        tmp_path / "staging",
        Supervisor([]),
        lambda *_: [],
        {},
        5.0,
        {},
        lambda: None,
    )
    listed = {model.name: model.error for model in control.catalog()}
    assert listed == {"alpha": UNLOADED, "beta": UNLOADED, "shared": DUPLICATE_REASON}


def test_something_in_the_view_sluice_did_not_put_there_is_refused(tmp_path: Path) -> None:
    first, second = _repositories(tmp_path)
    settings = _settings(tmp_path)
    root = snapshot_repository([str(first), str(second)], settings)
    (root / "planted").mkdir()
    with pytest.raises(SourceError, match="'planted', which Sluice did not put there"):
        snapshot_repository([str(first), str(second)], settings)
    (root / "planted").rmdir()
    (root / DUPLICATES_FILE).write_text("{not json")
    snapshot_repository([str(first), str(second)], settings)  # rewritten
    assert [m.name for m in scan_repository(root) if m.error] == ["shared"]


def test_a_missing_repository_among_several_is_a_clear_error(tmp_path: Path) -> None:
    first, _ = _repositories(tmp_path)
    with pytest.raises(SourceError, match=r"cannot list the model repository .*nothing"):
        snapshot_repository([str(first), str(tmp_path / "nothing")], _settings(tmp_path))


def test_settings_take_one_location_or_several() -> None:
    assert UpSettings(model_repository="/a").model_repository == ("/a",)
    assert UpSettings().model_repository == ("model_repository",)
    several = UpSettings(model_repository='["/a", "s3://b/c", "/a"]').model_repository
    assert several == ("/a", "s3://b/c")
    assert UpSettings(model_repository=locations_text(several)).model_repository == several
    assert locations_text(("/a",)) == "/a"
    assert ControllerSettings(model_repository="").model_repository == ()
    assert BatchStoreSettings(model_repository='["/a", "/b"]').model_repository == ("/a", "/b")
    with pytest.raises(ValueError, match="at least one model repository"):
        UpSettings(model_repository="[]")
    with pytest.raises(ValueError, match="not a JSON list of locations"):
        UpSettings(model_repository="[/a")
    with pytest.raises(ValueError, match="non-empty string"):
        UpSettings(model_repository='["/a", ""]')


def test_environment_names_several_repositories(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLUICE_MODEL_REPOSITORY", '["/a", "/b"]')
    assert UpSettings().model_repository == ("/a", "/b")
    monkeypatch.setenv("SLUICE_MODEL_REPOSITORY", "/just/one")
    assert UpSettings().model_repository == ("/just/one",)
