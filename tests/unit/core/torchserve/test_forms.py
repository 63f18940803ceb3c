"""A model store's other forms of a TorchServe model, ``.tar.gz`` archives and unarchived
folders, packed into a .mar: what ``torch-model-archiver`` writes packs as it is, and
nothing in them can turn against the host (links, names that climb, sizes, counts)."""

from __future__ import annotations

import io
import json
import os
import tarfile
import tracemalloc
import zipfile
import zlib
from pathlib import Path

import pytest

from sluice.core.errors import InvalidConfig
from sluice.core.torchserve.archives import MANIFEST, UnpackLimits, read_manifest
from sluice.core.torchserve.forms import form_of, is_model_entry, pack

MANIFEST_DOC = {"model": {"modelName": "greeter", "handler": "h.py", "modelVersion": "2.0"}}
FILES = {
    MANIFEST: json.dumps(MANIFEST_DOC).encode(),
    "h.py": b"def handle(data, context):\n    return data\n",
    "extra/vocab.txt": b"hello\nworld\n",
}


def _tgz(path: Path, files: dict[str, bytes], root: str = "greeter/") -> Path:
    with tarfile.open(path, "w:gz") as tar:
        if root:
            folder = tarfile.TarInfo(root.rstrip("/"))
            folder.type = tarfile.DIRTYPE
            tar.addfile(folder)
        for name, data in files.items():
            info = tarfile.TarInfo(root + name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def _folder(path: Path, files: dict[str, bytes]) -> Path:
    for name, data in files.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_bytes(data)
    return path


def _packed(path: Path) -> dict[str, bytes]:
    with zipfile.ZipFile(path) as archive:
        return {name: archive.read(name) for name in archive.namelist() if not name.endswith("/")}


@pytest.mark.parametrize("root", ["greeter/", "", "./"])
def test_a_tgz_packs_into_a_mar_with_the_same_files(tmp_path: Path, root: str) -> None:
    """torch-model-archiver's tgz holds one folder named after the model; `tar -C dir .`
    writes ./ before every name; either way the files are the model's."""
    source = _tgz(tmp_path / "greeter.tar.gz", FILES, root)
    assert form_of(source) == "tgz"
    manifest = pack(source, tmp_path / "out.mar", UnpackLimits())
    assert (manifest.model_name, manifest.version) == ("greeter", "2.0")
    assert _packed(tmp_path / "out.mar") == FILES
    assert read_manifest(tmp_path / "out.mar").handler == "h.py"


def test_a_folder_packs_into_a_mar_and_its_only_subfolder_stands_for_it(tmp_path: Path) -> None:
    flat = _folder(tmp_path / "flat", FILES)
    assert form_of(flat) == "folder" and is_model_entry(flat)
    pack(flat, tmp_path / "flat.mar", UnpackLimits())
    assert _packed(tmp_path / "flat.mar") == FILES
    nested = _folder(tmp_path / "nested" / "greeter", FILES).parent
    assert is_model_entry(nested)
    assert pack(nested, tmp_path / "nested.mar").model_name == "greeter"
    assert _packed(tmp_path / "nested.mar") == FILES
    first = (tmp_path / "flat.mar").read_bytes()
    pack(flat, tmp_path / "again.mar", UnpackLimits())
    assert (tmp_path / "again.mar").read_bytes() == first  # the same files, the same bytes


def test_a_mar_is_copied_as_it_is(tmp_path: Path) -> None:
    pack(_folder(tmp_path / "m", FILES), tmp_path / "m.mar", UnpackLimits())
    assert pack(tmp_path / "m.mar", tmp_path / "copy.mar").model_name == "greeter"
    assert (tmp_path / "copy.mar").read_bytes() == (tmp_path / "m.mar").read_bytes()


def test_store_entries_are_told_apart(tmp_path: Path) -> None:
    (tmp_path / "a.mar").write_bytes(b"PK")
    (tmp_path / "b.tar.gz").write_bytes(b"\x1f\x8b")
    (tmp_path / "notes.txt").write_text("not a model")
    (tmp_path / "empty").mkdir()
    assert [p.name for p in sorted(tmp_path.iterdir()) if is_model_entry(p)] == [
        "a.mar",
        "b.tar.gz",
    ]
    with pytest.raises(InvalidConfig, match=r"notes\.txt: neither a \.mar \(zip\) nor a \.tar"):
        form_of(tmp_path / "notes.txt")


def _tar_with(path: Path, info: tarfile.TarInfo, data: bytes = b"") -> Path:
    with tarfile.open(path, "w:gz") as tar:
        manifest = tarfile.TarInfo(MANIFEST)
        manifest.size = len(FILES[MANIFEST])
        tar.addfile(manifest, io.BytesIO(FILES[MANIFEST]))
        tar.addfile(info, io.BytesIO(data) if data else None)
    return path


def _link(name: str, kind: bytes, target: str) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, target
    return info


@pytest.mark.parametrize(
    ("info", "reason"),
    [
        (_link("model.pt", tarfile.SYMTYPE, "/etc/shadow"), "is not a plain file or folder"),
        (_link("model.pt", tarfile.LNKTYPE, MANIFEST), "is not a plain file or folder"),
        (tarfile.TarInfo("../escape.py"), "points outside the archive"),
        (tarfile.TarInfo("/etc/cron.d/x"), "points outside the archive"),
        (tarfile.TarInfo(MANIFEST), "appears twice"),
    ],
)
def test_a_tgz_with_links_or_names_that_climb_is_refused(
    tmp_path: Path, info: tarfile.TarInfo, reason: str
) -> None:
    source = _tar_with(tmp_path / "bad.tar.gz", info)
    with pytest.raises(InvalidConfig, match=reason):
        pack(source, tmp_path / "out.mar", UnpackLimits())
    assert not (tmp_path / "out.mar").exists() and not (tmp_path / "escape.py").exists()


def test_a_folder_with_a_link_is_refused(tmp_path: Path) -> None:
    folder = _folder(tmp_path / "m", FILES)
    os.symlink("/etc/hostname", folder / "model.pt")
    with pytest.raises(InvalidConfig, match=r"entry 'model\.pt' is a link"):
        pack(folder, tmp_path / "out.mar", UnpackLimits())
    assert not (tmp_path / "out.mar").exists()


def test_sizes_and_counts_are_bounded(tmp_path: Path) -> None:
    big = _tgz(tmp_path / "big.tar.gz", {**FILES, "model.pt": b"\0" * 5000})
    with pytest.raises(InvalidConfig, match="unpacks to more than 4096 bytes"):
        pack(big, tmp_path / "out.mar", UnpackLimits(total_bytes=4096))
    many = _folder(tmp_path / "many", {**FILES, **{f"f{i}": b"x" for i in range(8)}})
    with pytest.raises(InvalidConfig, match="more than 6 entries"):
        pack(many, tmp_path / "out.mar", UnpackLimits(entries=6))
    assert not (tmp_path / "out.mar").exists()


@pytest.mark.parametrize(
    ("files", "reason"),
    [
        ({"h.py": b"x"}, "MANIFEST.json is missing"),
        ({MANIFEST: b"{not json"}, "is not JSON"),
    ],
)
def test_a_form_without_a_good_manifest_is_refused(
    tmp_path: Path, files: dict[str, bytes], reason: str
) -> None:
    with pytest.raises(InvalidConfig, match=reason):
        pack(_folder(tmp_path / "m", files), tmp_path / "out.mar", UnpackLimits())
    with pytest.raises(InvalidConfig, match=reason):
        pack(_tgz(tmp_path / "m.tar.gz", files), tmp_path / "out.mar", UnpackLimits())


def test_a_damaged_tgz_is_refused(tmp_path: Path) -> None:
    source = _tgz(tmp_path / "m.tar.gz", FILES)
    data = source.read_bytes()
    source.write_bytes(data[: len(data) // 2])
    with pytest.raises(InvalidConfig, match=r"model archive m\.tar\.gz: .*damaged|cannot be read"):
        pack(source, tmp_path / "out.mar", UnpackLimits())
    assert not (tmp_path / "out.mar").exists()


def _header_then_zeros(path: Path, kind: bytes, claimed: int, zeros: int) -> Path:
    """A .tar.gz of the manifest, then a header of type ``kind`` claiming ``claimed``
    bytes, followed by ``zeros`` zero bytes only (cheap to compress: a bomb)."""
    manifest = FILES[MANIFEST]
    info = tarfile.TarInfo(MANIFEST)
    info.size = len(manifest)
    head = info.tobuf() + manifest + bytes(-len(manifest) % 512)
    info = tarfile.TarInfo("././@LongLink" if kind == tarfile.GNUTYPE_LONGNAME else "model.pt")
    info.type, info.size = kind, claimed
    head += info.tobuf(tarfile.GNU_FORMAT)
    compressor = zlib.compressobj(1, zlib.DEFLATED, 31)  # (31: the gzip format)
    with path.open("wb") as sink:
        sink.write(compressor.compress(head))
        block = bytes(1 << 20)
        for _ in range(zeros >> 20):
            sink.write(compressor.compress(block))
        sink.write(compressor.flush())
    return path


def test_a_tgz_header_claiming_a_huge_name_is_refused_without_reading_it(
    tmp_path: Path,
) -> None:
    """tarfile reads a long name (or a pax header) whole, as long as its header claims: a
    4 MiB .tar.gz claiming a 1 GiB name made the process hold a gigabyte (a 256 MiB one,
    hundreds). Reads of the archive are bounded instead."""
    source = _header_then_zeros(tmp_path / "m.tar.gz", tarfile.GNUTYPE_LONGNAME, 64 << 20, 64 << 20)
    tracemalloc.start()
    try:
        with pytest.raises(InvalidConfig, match=r"m\.tar\.gz: .*header of more than"):
            pack(source, tmp_path / "out.mar", UnpackLimits())
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, peak
    assert not (tmp_path / "out.mar").exists()


def test_a_tgz_entry_claiming_too_much_is_refused_before_it_is_read_past(tmp_path: Path) -> None:
    """Each entry's size is checked as soon as its header is read: the entry's bytes were
    inflated first (to reach the next header), minutes of CPU for a .tar.gz of zeros. Here
    they are not even there, and the refusal is still the size's."""
    source = _header_then_zeros(tmp_path / "m.tar.gz", tarfile.REGTYPE, 8 << 30, 0)
    with pytest.raises(InvalidConfig, match=r"unpacks to more than 4294967296 bytes \(by its"):
        pack(source, tmp_path / "out.mar", UnpackLimits())
    assert not (tmp_path / "out.mar").exists()
