"""A load whose files are added to the model's current ones (a TorchServe version
registered beside those served): the versions it does not touch stay as they are."""

from __future__ import annotations

import json
from pathlib import Path

import msgpack
import pytest

from sluice.core.control import ControlCommand, decode_command, encode_command
from sluice.core.errors import InvalidInput
from sluice.scheduler.repository.staging import stage

CONFIG = json.dumps({"backend": "torchserve", "max_batch_size": 2})


def test_kept_files_are_linked_and_the_new_ones_written(tmp_path: Path) -> None:
    current = tmp_path / "staged-1" / "m"
    (current / "1").mkdir(parents=True)
    (current / "1" / "model.mar").write_bytes(b"first")
    (current / "2").mkdir()
    (current / "2" / "model.mar").write_bytes(b"old second")
    (current / "config.pbtxt").write_text('backend: "torchserve"')
    files = {"2/model.mar": b"new second", "3/model.mar": b"third"}
    staged = stage(current, tmp_path / "staged-2", CONFIG, files, keep=True)
    assert (staged / "1" / "model.mar").read_bytes() == b"first"
    assert (staged / "1").is_symlink()
    assert (staged / "2" / "model.mar").read_bytes() == b"new second"
    assert not (staged / "2").is_symlink()  # written, never through a link into `current`
    assert (current / "2" / "model.mar").read_bytes() == b"old second"
    assert (staged / "3" / "model.mar").read_bytes() == b"third"
    assert "max_batch_size: 2" in (staged / "config.pbtxt").read_text()
    alone = stage(current, tmp_path / "staged-3", CONFIG, {"3/model.mar": b"third"})
    assert sorted(p.name for p in alone.iterdir()) == ["3", "config.pbtxt"]  # no keep


def test_keep_travels_with_the_command() -> None:
    command = ControlCommand("load", "m", CONFIG, {"2/model.mar": b"x"}, keep_files=True)
    assert decode_command(encode_command(command)) == command
    plain = decode_command(encode_command(ControlCommand("load", "m")))
    assert plain is not None and not plain.keep_files
    fields = {b"c": msgpack.packb({"id": "1", "op": "load", "model": "m", "keep": "yes"})}
    assert decode_command(fields) is None


def test_a_loads_configuration_replaces_the_custom_ones(tmp_path: Path) -> None:
    """Triton's --model-config-name picks configs/<name>.pbtxt over config.pbtxt; a load
    with a configuration of its own uses that one, so the staged copy has no configs/, and
    a file override cannot bring one back."""
    current = tmp_path / "repo" / "m"
    (current / "1").mkdir(parents=True)
    (current / "1" / "model.mar").write_bytes(b"first")
    (current / "configs").mkdir()
    (current / "configs" / "h100.pbtxt").write_text('backend: "torchserve"')
    staged = stage(current, tmp_path / "staged-1", CONFIG, {})
    assert sorted(p.name for p in staged.iterdir()) == ["1", "config.pbtxt"]
    kept = stage(current, tmp_path / "staged-2", CONFIG, {"2/model.mar": b"x"}, keep=True)
    assert sorted(p.name for p in kept.iterdir()) == ["1", "2", "config.pbtxt"]
    with pytest.raises(InvalidInput, match=r"'configs/h100.pbtxt': the load's configuration"):
        stage(current, tmp_path / "staged-3", CONFIG, {"configs/h100.pbtxt": b"x"})
