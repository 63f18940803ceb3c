"""Triton's checksum repository agent, carried out when a model is read: a model whose
files match its MD5 digests is usable, one that does not is unavailable with Triton's
text, and every bad key (no algorithm, another algorithm, a path out of the folder, a
missing file) or another agent is refused with a reason."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path
from typing import IO

import pytest

from sluice.core import repository_agents
from sluice.core.repository import read_model, scan_repository
from tests.support.onnx_models import write_identity


def with_agents(model_dir: Path, section: str) -> Path:
    config = model_dir / "config.pbtxt"
    config.write_text(config.read_text() + "\nmodel_repository_agents {\n" + section + "\n}\n")
    return model_dir


def checksum(*pairs: tuple[str, str]) -> str:
    parameters = "\n".join(f'parameters {{ key: "{k}" value: "{v}" }}' for k, v in pairs)
    return f'agents [ {{ name: "checksum"\n{parameters} }} ]'


def md5_of(path: Path) -> str:
    return hashlib.md5(path.read_bytes(), usedforsecurity=False).hexdigest()


def test_a_model_whose_files_match_is_usable(tmp_path: Path) -> None:
    model_dir = write_identity(tmp_path, "m", ["FP32"])
    onnx = model_dir / "1" / "model.onnx"
    with_agents(model_dir, checksum(("MD5:1/model.onnx", md5_of(onnx))))
    model = read_model(model_dir)
    assert model.error is None and model.usable


def test_a_mismatch_makes_the_model_unavailable_with_tritons_text(tmp_path: Path) -> None:
    model_dir = write_identity(tmp_path, "m", ["FP32"])
    onnx = model_dir / "1" / "model.onnx"
    good = md5_of(onnx)
    with_agents(model_dir, checksum(("md5:1/model.onnx", good)))
    assert read_model(model_dir).usable
    # The file changes (same size, a later time): read again, it no longer matches.
    data = bytearray(onnx.read_bytes())
    data[-1] ^= 0xFF
    onnx.write_bytes(bytes(data))
    stat = onnx.stat()
    os.utime(onnx, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    [model] = scan_repository(tmp_path)
    assert model.error == (
        f"Mismatched MD5 hash for file 1/model.onnx, expect: {good}, got: {md5_of(onnx)}"
    )


@pytest.mark.parametrize(
    ("key", "reason"),
    [
        ("1/model.onnx", "failed to parse key: 1/model.onnx"),
        ("SHA256:1/model.onnx", "Unsupported checksum algorithm: SHA256"),
        ("MD5:1/missing.onnx", "failed to open text file for read 1/missing.onnx: "),
        ("MD5:../other/1/model.onnx", "checksum agent: '../other/1/model.onnx' is not"),
        ("MD5:/etc/passwd", "checksum agent: '/etc/passwd' is not a file inside"),
        ("MD5:", "checksum agent: '' is not a file inside"),
    ],
)
def test_bad_keys_are_refused_with_the_reason(tmp_path: Path, key: str, reason: str) -> None:
    write_identity(tmp_path, "other", ["FP32"])
    model_dir = with_agents(write_identity(tmp_path, "m", ["FP32"]), checksum((key, "0" * 32)))
    model = read_model(model_dir)
    assert model.error is not None and model.error.startswith(reason), model.error


def test_another_agent_is_refused_naming_it(tmp_path: Path) -> None:
    model_dir = write_identity(tmp_path, "m", ["FP32"])
    with_agents(model_dir, 'agents [ { name: "relocation" } ]')
    model = read_model(model_dir)
    assert model.error is not None
    assert "repository agent 'relocation' is not available" in model.error


def same_size_and_time(path: Path, data: bytes, *, in_place: bool) -> None:
    """Write ``data`` (as long as what ``path`` holds) and give it back its time: in place,
    or as a new file renamed over it."""
    before = path.stat()
    assert len(data) == before.st_size
    target = path if in_place else path.with_name(path.name + ".tmp")
    target.write_bytes(data)
    os.utime(target, ns=(before.st_atime_ns, before.st_mtime_ns))
    if not in_place:
        target.replace(path)


@pytest.mark.parametrize("in_place", [True, False])
def test_a_file_changed_with_its_size_and_time_kept_is_read_again(
    tmp_path: Path, in_place: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A digest was remembered by file, size and modification time: a file changed without
    changing those (``touch -r``, a copy renamed over it) passed with the digest of what it
    held before."""
    model_dir = write_identity(tmp_path, "m", ["FP32"])
    onnx = model_dir / "1" / "model.onnx"
    good = md5_of(onnx)
    with_agents(model_dir, checksum(("MD5:1/model.onnx", good)))
    later = time.time_ns() + repository_agents._SETTLED_NS  # (every file has settled)
    monkeypatch.setattr(repository_agents, "_clock_ns", lambda: later)
    assert read_model(model_dir).usable
    time.sleep(0.05)  # (beyond the file system's step of time)
    data = bytearray(onnx.read_bytes())
    data[-1] ^= 0xFF
    same_size_and_time(onnx, bytes(data), in_place=in_place)
    assert read_model(model_dir).error == (
        f"Mismatched MD5 hash for file 1/model.onnx, expect: {good}, got: {md5_of(onnx)}"
    )


def test_a_digest_is_remembered_once_the_file_has_settled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A poll of an unchanged repository does not read its files again; a file written
    just now is read each time (a change within the file system's time granularity keeps
    every time the same)."""
    model_dir = write_identity(tmp_path, "m", ["FP32"])
    onnx = model_dir / "1" / "model.onnx"
    with_agents(model_dir, checksum(("MD5:1/model.onnx", md5_of(onnx))))
    reads: list[IO[bytes]] = []
    real = repository_agents._read_md5

    def counted(file: IO[bytes]) -> str:
        reads.append(file)
        return real(file)

    monkeypatch.setattr(repository_agents, "_read_md5", counted)
    written = onnx.stat().st_ctime_ns
    monkeypatch.setattr(repository_agents, "_clock_ns", lambda: written)
    assert read_model(model_dir).usable and read_model(model_dir).usable
    assert len(reads) == 2
    later = written + repository_agents._SETTLED_NS
    monkeypatch.setattr(repository_agents, "_clock_ns", lambda: later)
    assert read_model(model_dir).usable and read_model(model_dir).usable
    assert len(reads) == 3


def test_a_key_that_names_no_regular_file_is_refused_without_reading(tmp_path: Path) -> None:
    """A FIFO would block the read for ever, a device (through a link) read without end; a
    NUL byte in the path raised ValueError out of the scan."""
    model_dir = write_identity(tmp_path, "m", ["FP32"])
    os.mkfifo(model_dir / "fifo")
    (model_dir / "zero").symlink_to("/dev/zero")
    keys = [("MD5:fifo", "0" * 32), ("MD5:zero", "0" * 32), ("MD5:1", "0" * 32)]
    for key in keys:
        config = (model_dir / "config.pbtxt").read_text()
        with_agents(model_dir, checksum(key))
        error = read_model(model_dir).error
        assert error is not None and error.startswith(
            f"failed to open text file for read {key[0][4:]}: "
        )
        (model_dir / "config.pbtxt").write_text(config)
    with_agents(model_dir, checksum(("MD5:1/model.onnx\\000x", "0" * 32)))
    error = read_model(model_dir).error
    assert error is not None and "is not a file inside the model's folder" in error
