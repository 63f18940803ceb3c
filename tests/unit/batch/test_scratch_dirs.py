"""A batch worker's scratch directory (downloaded inputs, parts being written) outlives a
worker that is killed: nothing of that worker removes it. The next batch worker to start
removes those whose owner is gone (their lock free), and leaves alone those of live
workers and folders that are not batch workers' own."""

from __future__ import annotations

import fcntl
import tempfile
from pathlib import Path

import pytest

from sluice.batch.storage import Storage
from sluice.core.settings import BatchSettings


def test_scratch_left_by_killed_workers_is_removed_and_live_ones_are_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead, alive, other = (tmp_path / f"sluice-batch-{n}" for n in ("dead", "alive", "bench-1"))
    for folder in (dead, alive, other):
        (folder / "inputs").mkdir(parents=True)
        (folder / "inputs" / "input.npy").write_bytes(b"\0" * 4096)
    (dead / ".lock").touch()
    with (alive / ".lock").open("wb") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # its worker lives
        first = Storage(BatchSettings())
        second = Storage(BatchSettings())
        try:
            assert not dead.exists()
            assert (alive / "inputs" / "input.npy").is_file()
            assert (other / "inputs" / "input.npy").is_file()
            assert first.scratch.is_dir() and second.scratch.is_dir()
            assert first.scratch.parent == tmp_path
        finally:
            first.close()
            second.close()
    assert not first.scratch.exists() and not second.scratch.exists()
