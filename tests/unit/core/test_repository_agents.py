"""Triton's checksum repository agent, carried out when a model is read: a model whose
files match its MD5 digests is usable, one that does not is unavailable with Triton's
text, and every bad key (no algorithm, another algorithm, a path out of the folder, a
missing file) or another agent is refused with a reason."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

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
