"""TorchServe model archives: the manifest, and unpacking that nothing in the archive can
turn against the host."""

from __future__ import annotations

import json
import stat
import zipfile
from pathlib import Path
from typing import Any

import pytest

from sluice.core.errors import InvalidConfig
from sluice.core.torchserve.archives import (
    MANIFEST,
    UnpackLimits,
    read_manifest,
    registered_runtime,
    unpack,
)

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


def _with_version(tmp_path: Path, version_json: str) -> Path:
    """An archive whose manifest's modelVersion is ``version_json`` (its JSON text; "" for
    none), as a hand-made manifest may have it."""
    field = f', "modelVersion": {version_json}' if version_json else ""
    text = '{"runtime": "python", "model": {"modelName": "m", "handler": "h.py"' + field + "}}"
    return _archive(tmp_path, {MANIFEST: text.encode()})


@pytest.mark.parametrize("version_json", ["", "null"])
def test_a_manifest_without_a_version_is_refused_as_torchserve_does(
    tmp_path: Path, version_json: str
) -> None:
    """TorchServe answers 400 ``Model version is not defined.``; Sluice took 1.0."""
    with pytest.raises(InvalidConfig, match=r"Model version is not defined\.$"):
        read_manifest(_with_version(tmp_path, version_json))


@pytest.mark.parametrize(
    ("version_json", "version"),
    [("2", "2"), ("1.0", "1.0"), ("1.50", "1.50"), ("1e3", "1e3"), ("true", "true")],
)
def test_a_number_version_is_its_json_text_as_in_torchserve(
    tmp_path: Path, version_json: str, version: str
) -> None:
    """TorchServe's manifest reader (Gson) takes a JSON number or boolean for a text as its
    text; Sluice refused it ("must be a non-empty string")."""
    assert read_manifest(_with_version(tmp_path, version_json)).version == version


@pytest.mark.parametrize(
    ("version_json", "reason"),
    [('""', "'model.modelVersion' is empty"), ("[1]", "'model.modelVersion' must be a string")],
)
def test_an_empty_or_structured_version_is_refused(
    tmp_path: Path, version_json: str, reason: str
) -> None:
    with pytest.raises(InvalidConfig, match=reason):
        read_manifest(_with_version(tmp_path, version_json))


def _with_runtime(tmp_path: Path, runtime_json: str) -> Path:
    """An archive whose manifest's runtime is ``runtime_json`` (its JSON text; "" for
    none)."""
    field = f'"runtime": {runtime_json}, ' if runtime_json else ""
    model = '"model": {"modelName": "m", "handler": "h.py", "modelVersion": "1.0"}'
    return _archive(tmp_path, {MANIFEST: ("{" + field + model + "}").encode()})


@pytest.mark.parametrize(
    ("runtime_json", "runtime"),
    [
        ("", "python"),
        ('"python"', "python"),
        ('"python3"', "python3"),
        ("null", ""),
        ('"java"', ""),
        ('"python2"', ""),
        ("3", ""),
        ("true", ""),
    ],
)
def test_the_runtime_is_read_as_torchserve_reads_it(
    tmp_path: Path, runtime_json: str, runtime: str
) -> None:
    """Absent: TorchServe's default, python; one it does not know: none."""
    assert read_manifest(_with_runtime(tmp_path, runtime_json)).runtime == runtime


def test_a_registration_refuses_an_unknown_runtime_unless_it_names_one(tmp_path: Path) -> None:
    """TorchServe's 400 ``Runtime is not defined or invalid.``; Sluice registered it."""
    manifest = read_manifest(_with_runtime(tmp_path, "null"))
    with pytest.raises(InvalidConfig, match=r"^model archive m\.mar: Runtime is not defined"):
        registered_runtime(manifest, None, "m.mar")
    assert registered_runtime(manifest, "python3", "m.mar") == "python3"


def test_a_worker_serves_an_archive_laid_out_by_hand_whatever_its_runtime(
    tmp_path: Path,
) -> None:
    """Only a registration checks the runtime (as a missing modelVersion)."""
    manifest = unpack(_with_runtime(tmp_path, '"java"'), tmp_path / "out", max_bytes=1 << 20)
    assert (manifest.model_name, manifest.runtime) == ("m", "")


def test_a_file_that_is_not_a_zip_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "x.mar"
    path.write_bytes(b"not a zip")
    with pytest.raises(InvalidConfig, match="not a readable zip archive"):
        read_manifest(path)


def _manifest_and(entries: dict[str, bytes]) -> dict[str, bytes]:
    return {MANIFEST: json.dumps(MANIFEST_DOC).encode(), **entries}


def _patch_directory(path: Path, entry: str, offset: int, value: bytes) -> None:
    """Rewrite a field of ``entry``'s record in the central directory (what readers trust)."""
    data = bytearray(path.read_bytes())
    at = data.find(b"PK\x01\x02")
    while at >= 0:
        name_length = int.from_bytes(data[at + 28 : at + 30], "little")
        if data[at + 46 : at + 46 + name_length] == entry.encode():
            data[at + offset : at + offset + len(value)] = value
            path.write_bytes(bytes(data))
            return
        at = data.find(b"PK\x01\x02", at + 4)
    raise AssertionError(f"{entry} not in the central directory")


def _lie_about_size(path: Path, entry: str, claimed: int) -> None:
    _patch_directory(path, entry, 24, claimed.to_bytes(4, "little"))


@pytest.mark.parametrize("entry", [".", "./", "./model.pt", "extra/./vocab.txt", "a//b", "/"])
def test_names_that_are_not_one_plain_path_are_refused_before_unpacking(
    tmp_path: Path, entry: str
) -> None:
    """An entry named ``.`` used to reach the writing step (a FileExistsError there, which
    the worker reported as a failing handler): now every such name is the same clear
    refusal as the other bad entries, from the manifest check already."""
    path = tmp_path / "dot.mar"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(MANIFEST, json.dumps(MANIFEST_DOC))
        archive.writestr(zipfile.ZipInfo(entry), b"x")
    with pytest.raises(InvalidConfig, match=r"model archive dot\.mar: entry .*(inside|outside)"):
        read_manifest(path)
    with pytest.raises(InvalidConfig, match=r"model archive dot\.mar: entry"):
        unpack(path, tmp_path / "out", max_bytes=1 << 20)
    assert not (tmp_path / "out").exists()


def test_a_file_that_is_also_a_folder_is_refused(tmp_path: Path) -> None:
    path = _archive(tmp_path, _manifest_and({"extra": b"file", "extra/vocab.txt": b"a"}))
    with pytest.raises(InvalidConfig, match="'extra' is both a file and a folder"):
        unpack(path, tmp_path / "out", max_bytes=1 << 20)
    assert not (tmp_path / "out").exists()


def test_the_entry_count_is_bounded(tmp_path: Path) -> None:
    path = _archive(tmp_path, _manifest_and({f"f{i}.txt": b"x" for i in range(10)}))
    with pytest.raises(InvalidConfig, match="more than 5 entries"):
        unpack(path, tmp_path / "out", limits=UnpackLimits(total_bytes=1 << 20, entries=5))
    unpack(path, tmp_path / "out", limits=UnpackLimits(total_bytes=1 << 20, entries=11))
    assert len(list((tmp_path / "out").iterdir())) == 11


def test_each_entry_is_bounded(tmp_path: Path) -> None:
    path = _archive(tmp_path, _manifest_and({"model.pt": b"w" * 5000}))
    limits = UnpackLimits(total_bytes=1 << 20, entry_bytes=4096)
    with pytest.raises(InvalidConfig, match=r"entry 'model\.pt' unpacks to more than 4096 bytes"):
        unpack(path, tmp_path / "out", limits=limits)
    assert not (tmp_path / "out").exists()


def test_a_directory_claiming_too_much_is_refused_before_writing(tmp_path: Path) -> None:
    path = _archive(tmp_path, _manifest_and({"model.pt": b"weights"}))
    _lie_about_size(path, "model.pt", 0xFFFF_FF00)  # claims ~4 GiB
    with pytest.raises(
        InvalidConfig, match=r"unpacks to more than 1048576 bytes \(by its directory"
    ):
        unpack(path, tmp_path / "out", max_bytes=1 << 20)
    assert not (tmp_path / "out").exists()


def test_a_directory_claiming_too_little_stops_while_writing(tmp_path: Path) -> None:
    """The directory says 10 bytes, the entry inflates to 8 MiB: the check before writing
    passes, and the copy stops at what was claimed (never past the limit), and fails."""
    path = _archive(tmp_path, _manifest_and({"model.pt": b"\0" * (8 << 20)}))
    _lie_about_size(path, "model.pt", 10)
    with pytest.raises(InvalidConfig, match=r"entry 'model\.pt' (is damaged|holds more than)"):
        unpack(path, tmp_path / "out", max_bytes=1 << 20)
    assert not (tmp_path / "out").exists()


def test_the_default_bound_is_four_gib(tmp_path: Path) -> None:
    path = _archive(tmp_path, _manifest_and({"model.pt": b"weights"}))
    _lie_about_size(path, "model.pt", 0xFFFF_FFFF)  # with the manifest: just over 4 GiB
    with pytest.raises(InvalidConfig, match="unpacks to more than 4294967296 bytes"):
        unpack(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_encrypted_entries_are_refused(tmp_path: Path) -> None:
    path = _archive(tmp_path, _manifest_and({"model.pt": b"secret"}))
    _patch_directory(path, "model.pt", 8, (1).to_bytes(2, "little"))  # flag: encrypted
    with pytest.raises(InvalidConfig, match=r"entry 'model\.pt' is encrypted"):
        read_manifest(path)


def _records(tmp_path: Path, count: int, claimed: int | None = None) -> Path:
    """An archive of its manifest whose central directory holds ``count`` records (each
    pointing at the manifest's bytes, as a crafted archive can: a record costs 47 bytes);
    ``claimed``: the entry count its end record gives (default: the true one)."""
    tmp_path.mkdir()
    path = _archive(tmp_path, _manifest_and({}))
    data = path.read_bytes()
    start = data.find(b"PK\x01\x02")
    end = data.find(b"PK\x05\x06")
    record = bytearray(data[start:end])
    directory = b"".join(
        bytes(record[:28]) + len(name).to_bytes(2, "little") + bytes(record[30:46]) + name
        for name in [MANIFEST.encode(), *(f"{i:x}".encode() for i in range(1, count))]
    )
    total = (claimed if claimed is not None else count).to_bytes(2, "little")
    tail = b"PK\x05\x06" + bytes(4) + total + total
    tail += len(directory).to_bytes(4, "little") + start.to_bytes(4, "little") + bytes(2)
    path.write_bytes(data[:start] + directory + tail)
    return path


@pytest.mark.parametrize("claimed", [None, 1])
def test_a_directory_of_too_many_records_is_refused_before_zipfile_reads_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, claimed: int | None
) -> None:
    """zipfile makes an object of every record of the central directory before anyone can
    count them: a 256 MiB archive of 47-byte records held the gateway for minutes and
    gigabytes. The records are counted first, whatever the end record claims."""
    path = _records(tmp_path / "many", 10_001, claimed)
    six = _records(tmp_path / "six", 6, claimed and 1)
    opened: list[object] = []
    real = zipfile.ZipFile

    def watched(*args: Any, **kwargs: Any) -> zipfile.ZipFile:
        opened.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(zipfile, "ZipFile", watched)
    with pytest.raises(InvalidConfig, match="more than 10000 entries"):
        read_manifest(path)
    with pytest.raises(InvalidConfig, match="more than 5 entries"):
        unpack(six, tmp_path / "out", limits=UnpackLimits(entries=5))
    assert opened == [] and not (tmp_path / "out").exists()
    monkeypatch.undo()
    assert read_manifest(_records(tmp_path / "one", 1, claimed)).model_name == "doubler"


@pytest.mark.parametrize(
    "entry", ["/".join(["a"] * 600) + "/f.txt", "extra/" + "b" * 256, "c" * 1025]
)
def test_names_longer_than_a_path_are_refused_before_unpacking(tmp_path: Path, entry: str) -> None:
    """Such a name used to reach the writing step: 600 folders deep, a RecursionError from
    making the folders; a part or a path too long, an OSError naming the worker's temporary
    folder. Either failed the worker's load as a failing handler."""
    path = _archive(tmp_path, _manifest_and({entry: b"x"}))
    with pytest.raises(InvalidConfig, match="has a name longer than 1024 bytes, or a part"):
        read_manifest(path)
    with pytest.raises(InvalidConfig, match="has a name longer than 1024 bytes, or a part"):
        unpack(path, tmp_path / "out", max_bytes=1 << 20)
    assert not (tmp_path / "out").exists()
