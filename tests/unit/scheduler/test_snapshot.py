"""Model snapshots on disk (TorchServe's): the models loaded and the load commands of those
that had their own, written after each change and read back at the next start; a snapshot
that cannot be read is left out with a warning."""

from __future__ import annotations

from pathlib import Path

import pytest

from sluice.core.control import ControlCommand
from sluice.scheduler.executor.snapshot import INDEX, Snapshots


def test_what_was_loaded_and_how_comes_back(tmp_path: Path) -> None:
    snapshots = Snapshots(tmp_path / "snapshots")
    assert snapshots.restore() is None  # (no snapshot yet)
    tuned = ControlCommand("load", "tuned", config='{"max_batch_size": 2}')
    snapshots.save(["plain", "tuned"], tuned)
    odd = ControlCommand("load", "../odd name", config="{}", files={"1/m": b"x"})
    snapshots.save(["plain", "tuned", "../odd name"], odd)
    restored = snapshots.restore()
    assert restored is not None
    names, commands = restored
    assert names == {"plain", "tuned", "../odd name"}
    assert set(commands) == {"tuned", "../odd name"}
    assert commands["tuned"].config == '{"max_batch_size": 2}'
    assert commands["../odd name"].files == {"1/m": b"x"}
    assert all(path.parent.name == "loads" for path in (tmp_path / "snapshots").rglob("*.load"))


def test_a_plain_load_or_an_unload_forgets_how(tmp_path: Path) -> None:
    snapshots = Snapshots(tmp_path)
    snapshots.save(["m"], ControlCommand("load", "m", config="{}"))
    snapshots.save(["m"], ControlCommand("load", "m"))
    assert snapshots.restore() == ({"m"}, {})
    snapshots.save(["m"], ControlCommand("load", "m", versions=(2,)))
    snapshots.save([], ControlCommand("unload", "m"))
    assert snapshots.restore() == (set(), {})


def test_a_version_added_keeps_the_files_of_the_first(tmp_path: Path) -> None:
    snapshots = Snapshots(tmp_path)
    snapshots.save(["ts"], ControlCommand("load", "ts", config="{}", files={"1/a.mar": b"1"}))
    added = ControlCommand("load", "ts", config="{}", files={"2/a.mar": b"2"}, keep_files=True)
    snapshots.save(["ts"], added)
    restored = snapshots.restore()
    assert restored is not None
    assert restored[1]["ts"].files == {"1/a.mar": b"1", "2/a.mar": b"2"}


@pytest.mark.parametrize("index", [b"not json", b'{"models": "m"}', b"{}", b'{"models": [1]}'])
def test_a_snapshot_that_cannot_be_read_is_left_out(
    tmp_path: Path, index: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / INDEX).write_bytes(index)
    assert Snapshots(tmp_path).restore() is None
    assert "not restoring the model snapshot" in caplog.text


def test_a_malformed_record_leaves_its_model_to_the_repository(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    snapshots = Snapshots(tmp_path)
    snapshots.save(["m"], ControlCommand("load", "m", config="{}"))
    [record] = (tmp_path / "loads").iterdir()
    record.write_bytes(b"\x00garbled")
    assert snapshots.restore() == ({"m"}, {})
    assert "ignoring the malformed record of how 'm' was loaded" in caplog.text
