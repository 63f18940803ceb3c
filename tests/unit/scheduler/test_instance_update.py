"""Telling an update of a model's instances from a reload, without a server: the files a
load reads, the configurations compared, and which workers keep their place."""

from __future__ import annotations

import json
import os
from pathlib import Path

from sluice.core.repository import read_model
from sluice.scheduler.executor.instance_update import fingerprint, instances_only, plan
from sluice.scheduler.executor.supervisor import Child, ChildSpec
from sluice.scheduler.repository.staging import stage
from tests.support.onnx_models import write_identity


def config_with(model_dir: Path, **changes: object) -> str:
    """The model's configuration as JSON (as a load sends it), with ``changes``."""
    config = read_model(model_dir).config
    assert config is not None
    return json.dumps({**dict(config.raw), **changes})


def test_a_staged_copy_reads_the_same_files_until_one_changes(tmp_path: Path) -> None:
    write_identity(tmp_path / "repo", "m", ["FP32"])
    source = tmp_path / "repo" / "m"
    staged = stage(source, tmp_path / "staged", config_with(source, max_batch_size=2), {})
    assert fingerprint(staged) == fingerprint(source)
    assert any(path == "1/model.onnx" for path, _, _ in fingerprint(source))
    (source / "config.pbtxt").write_text((source / "config.pbtxt").read_text() + "\n")
    assert fingerprint(staged) == fingerprint(source)  # (the configuration is not a file)
    before = fingerprint(staged)
    model_file = source / "1" / "model.onnx"
    stat = model_file.stat()
    os.utime(model_file, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    assert fingerprint(staged) != before  # (modified, as Triton judges it: its time)
    before = fingerprint(source)
    (source / "2").mkdir()
    assert fingerprint(source) == before  # (an empty directory holds no file)
    (source / "notes.txt").write_text("added")
    assert fingerprint(source) != before


def test_only_instance_changes_are_an_update(tmp_path: Path) -> None:
    write_identity(tmp_path / "repo", "m", ["FP32"])
    source = tmp_path / "repo" / "m"
    old = read_model(source)

    def staged(name: str, **changes: object) -> Path:
        return stage(source, tmp_path / name, config_with(source, **changes), {})

    two = read_model(staged("two", instance_group=[{"kind": "KIND_CPU", "count": 2}]))
    assert instances_only(old, two)
    bounds = {"sluice.min_instances": {"string_value": "1"}}
    scaled = read_model(staged("bounds", instance_group=[{"count": 3}], parameters={**bounds}))
    assert instances_only(two, scaled)
    other = read_model(staged("other", max_batch_size=2))
    assert not instances_only(old, other)
    parameter = read_model(staged("parameter", parameters={"x": {"string_value": "1"}}))
    assert not instances_only(old, parameter)


def test_a_sequence_model_is_always_reloaded(tmp_path: Path) -> None:
    write_identity(tmp_path / "repo", "m", ["FP32"])
    source = tmp_path / "repo" / "m"
    sequence = {"max_sequence_idle_microseconds": 5_000_000}

    def staged(name: str, count: int) -> Path:
        changes = {"sequence_batching": sequence, "instance_group": [{"count": count}]}
        return stage(source, tmp_path / name, config_with(source, **changes), {})

    one, three = read_model(staged("one", 1)), read_model(staged("three", 3))
    assert one.config is not None and one.config.sequence_batching is not None
    assert not instances_only(one, three)


def worker(version: int, slot: int, kind: str = "KIND_CPU", gpu: int | None = None) -> Child:
    return Child(spec(version, slot, kind, gpu))


def spec(version: int, slot: int, kind: str = "KIND_CPU", gpu: int | None = None) -> ChildSpec:
    argv = ["python", "-m", "sluice.workers", "--kind", kind, "--slot", str(slot)]
    if gpu is not None:
        argv += ["--gpu", str(gpu)]
    return ChildSpec(f"worker m:{version}#{slot}", argv, {}, version=version)


def test_workers_keep_the_places_the_new_configuration_still_has() -> None:
    running = [worker(1, 0), worker(1, 1), worker(2, 0)]
    kept, starting = plan(running, [spec(1, 0), spec(2, 0), spec(2, 1)])
    assert kept == [running[0], running[2]]
    assert [(s.version, s.argv[-1]) for s in starting] == [(2, "1")]
    kept, starting = plan(running, [spec(1, 0)])  # down to one: the others go
    assert kept == [running[0]] and starting == []


def test_a_worker_on_another_device_is_not_kept() -> None:
    running = [worker(1, 0, "KIND_GPU", 0), worker(1, 1, "KIND_GPU", 1)]
    kept, starting = plan(running, [spec(1, 0, "KIND_GPU", 1), spec(1, 1, "KIND_GPU", 1)])
    assert kept == [running[1]]
    assert [s.argv[-1] for s in starting] == ["1"]


def test_a_retiring_worker_is_not_kept() -> None:
    leaving = worker(1, 0)
    leaving.retiring = True
    kept, starting = plan([leaving], [spec(1, 0)])
    assert kept == [] and len(starting) == 1


def test_custom_configurations_are_configurations_not_files(tmp_path: Path) -> None:
    """Editing configs/<name>.pbtxt (Triton's --model-config-name) changes a configuration,
    which :func:`instances_only` judges, not the files the workers load."""
    write_identity(tmp_path / "repo", "m", ["FP32"])
    source = tmp_path / "repo" / "m"
    before = fingerprint(source)
    (source / "configs").mkdir()
    custom = (source / "config.pbtxt").read_text()
    (source / "configs" / "h100.pbtxt").write_text(custom)
    assert fingerprint(source) == before
    (source / "configs" / "h100.pbtxt").write_text(
        custom + "instance_group [ { count: 2 kind: KIND_CPU } ]\n"
    )
    assert fingerprint(source) == before
    assert instances_only(read_model(source), read_model(source, "h100"))
    (source / "configs" / "notes.txt").write_text("not a configuration")
    assert fingerprint(source) != before
