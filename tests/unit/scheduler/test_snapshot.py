"""Model snapshots on disk (TorchServe's): the models loaded and the load commands of those
that had their own, written after each change and read back at the next start; a snapshot
that cannot be read is left out with a warning."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from sluice.core.control import ControlCommand
from sluice.scheduler.executor import snapshot
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


def test_a_deeply_nested_index_is_left_out(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """json's RecursionError is no ValueError: it ended ``sluice up`` at its start."""
    (tmp_path / INDEX).write_bytes(b"[" * 200_000)
    assert Snapshots(tmp_path).restore() is None
    assert "not restoring the model snapshot" in caplog.text


def test_an_index_that_is_not_a_regular_file_is_left_out(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A FIFO (or a link to one, or to a device) in its place would block the start for ever
    or read without end."""
    os.mkfifo(tmp_path / INDEX)
    assert Snapshots(tmp_path).restore() is None
    assert "not a regular file" in caplog.text


def test_files_larger_than_their_bound_are_left_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    snapshots = Snapshots(tmp_path)
    snapshots.save(["m"], ControlCommand("load", "m", config="{}", files={"1/f": b"x" * 64}))
    monkeypatch.setattr(snapshot, "RECORD_MAX_BYTES", 32)
    assert snapshots.restore() == ({"m"}, {})
    assert "larger than 32 bytes" in caplog.text
    monkeypatch.setattr(snapshot, "INDEX_MAX_BYTES", 4)
    assert snapshots.restore() is None
    assert "not restoring the model snapshot" in caplog.text
    snapshots.save(["m"], ControlCommand("load", "m", config="{}", files={"1/f": b"x" * 64}))
    assert not list((tmp_path / "loads").iterdir())  # (nor is one written)
    assert "not keeping how 'm' was loaded in the model snapshot" in caplog.text


def test_a_long_model_name_has_a_record_too(tmp_path: Path) -> None:
    """Up to 255 bytes of name (:func:`check_model_name`): twice that in hex was longer than
    a file name may be, so neither the record nor the index of such a model was written."""
    name = "é" * 127  # (254 bytes)
    snapshots = Snapshots(tmp_path)
    snapshots.save([name], ControlCommand("load", name, config="{}"))
    restored = snapshots.restore()
    assert restored is not None and set(restored[1]) == {name}
    snapshots.save([], ControlCommand("unload", name))
    assert snapshots.restore() == (set(), {})


def test_each_write_has_a_staged_file_of_its_own_synced_before_the_rename(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two executors may share a snapshot folder: while one writes, the other's whole save
    runs; neither takes the other's staged file. And each file is on disk before it takes
    the place of the previous one (a crash leaves one or the other, never an empty file)."""
    snapshots = Snapshots(tmp_path)
    synced: set[int] = set()
    real_fsync, real_replace = os.fsync, os.replace
    interleaved = False

    def fsync(fd: int) -> None:
        synced.add(os.fstat(fd).st_ino)
        real_fsync(fd)

    def replace(source: str | os.PathLike[str], target: str | os.PathLike[str]) -> None:
        nonlocal interleaved
        assert os.stat(source).st_ino in synced
        if not interleaved:
            interleaved = True
            snapshots.save(["other"], ControlCommand("load", "other", config="{}"))
        real_replace(source, target)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    snapshots.save(["m"], ControlCommand("load", "m", config="{}"))
    restored = snapshots.restore()
    assert restored is not None and restored[0] == {"m"}
    assert set(restored[1]) == {"m"}  # ("other"'s record is there, but not in the index)
    assert sorted(p.name for p in tmp_path.iterdir()) == [INDEX, "loads"]


def test_a_name_that_is_no_text_is_not_loaded(tmp_path: Path) -> None:
    """JSON may hold half a surrogate pair, which UTF-8 cannot encode: finding its record
    raised UnicodeEncodeError."""
    (tmp_path / INDEX).write_bytes(b'{"models": ["\\ud800", "m"]}')
    assert Snapshots(tmp_path).restore() == ({"\ud800", "m"}, {})
