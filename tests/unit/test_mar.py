"""TorchServe model archives: the manifest, and unpacking that nothing in the archive can
turn against the host."""

from __future__ import annotations

import json
import stat
import zipfile
from pathlib import Path

import pytest

from sluice.errors import InvalidConfig
from sluice.mar import MANIFEST, read_manifest, unpack

MANIFEST_DOC = {
    "createdOn": "25/11/2026 08:00:00",
    "runtime": "python",
    "model": {
        "modelName": "doubler",
        "handler": "handler.py",
        "serializedFile": "model.pt",
        "modelVersion": "2.0",
        "requirementsFile": "requirements.txt",
    },
    "archiverVersion": "0.12.0",
}


def _archive(tmp_path: Path, entries: dict[str, bytes], name: str = "m.mar") -> Path:
    path = tmp_path / name
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        for entry, data in entries.items():
            archive.writestr(entry, data)
    return path


def _good(tmp_path: Path) -> Path:
    return _archive(
        tmp_path,
        {
            MANIFEST: json.dumps(MANIFEST_DOC).encode(),
            "handler.py": b"def handle(data, context):\n    return data\n",
            "model.pt": b"weights",
            "extra/vocab.txt": b"a\nb\n",
        },
    )


def test_the_manifest_reads_without_unpacking(tmp_path: Path) -> None:
    manifest = read_manifest(_good(tmp_path))
    assert (manifest.model_name, manifest.handler, manifest.serialized_file) == (
        "doubler",
        "handler.py",
        "model.pt",
    )
    assert manifest.version == "2.0" and manifest.requirements_file == "requirements.txt"


def test_unpacking_writes_the_files(tmp_path: Path) -> None:
    target = tmp_path / "out"
    unpack(_good(tmp_path), target, max_bytes=1 << 20)
    assert (target / "extra" / "vocab.txt").read_bytes() == b"a\nb\n"
    assert (target / "MAR-INF" / "MANIFEST.json").is_file()


@pytest.mark.parametrize(
    ("entry", "reason"),
    [
        ("../escape.py", "points outside the archive"),
        ("/etc/passwd", "points outside the archive"),
        ("a\\..\\b", "points outside the archive"),
    ],
)
def test_names_that_leave_the_folder_are_refused(tmp_path: Path, entry: str, reason: str) -> None:
    path = _archive(tmp_path, {MANIFEST: json.dumps(MANIFEST_DOC).encode(), entry: b"x"})
    with pytest.raises(InvalidConfig, match=reason):
        unpack(path, tmp_path / "out", max_bytes=1 << 20)
    assert not (tmp_path / "out").exists() and not (tmp_path / "escape.py").exists()


def test_links_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "link.mar"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(MANIFEST, json.dumps(MANIFEST_DOC))
        link = zipfile.ZipInfo("model.pt")
        link.external_attr = (stat.S_IFLNK | 0o777) << 16
        archive.writestr(link, "/etc/shadow")
    with pytest.raises(InvalidConfig, match="is not a plain file or folder"):
        read_manifest(path)


def test_a_compressed_bomb_stops_at_the_limit(tmp_path: Path) -> None:
    path = _archive(
        tmp_path, {MANIFEST: json.dumps(MANIFEST_DOC).encode(), "model.pt": b"\0" * (8 << 20)}
    )
    assert path.stat().st_size < 100_000
    with pytest.raises(InvalidConfig, match="unpacks to more than 1048576 bytes"):
        unpack(path, tmp_path / "out", max_bytes=1 << 20)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("entries", "reason"),
    [
        ({"handler.py": b""}, "MANIFEST.json is missing"),
        ({MANIFEST: b"{not json"}, "is not JSON"),
        ({MANIFEST: b"[]"}, "has no 'model' object"),
        ({MANIFEST: json.dumps({"model": {"handler": "h.py"}}).encode()}, "'model.modelName'"),
        (
            {MANIFEST: json.dumps({"model": {"modelName": "m", "handler": 3}}).encode()},
            "'model.handler' must be a non-empty string",
        ),
    ],
)
def test_a_bad_manifest_says_what_is_wrong(
    tmp_path: Path, entries: dict[str, bytes], reason: str
) -> None:
    with pytest.raises(InvalidConfig, match=reason):
        read_manifest(_archive(tmp_path, entries))


def test_a_file_that_is_not_a_zip_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "x.mar"
    path.write_bytes(b"not a zip")
    with pytest.raises(InvalidConfig, match="not a readable zip archive"):
        read_manifest(path)
