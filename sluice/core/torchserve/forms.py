"""The forms a TorchServe model takes in a model store, made one: a ``.mar`` (a zip), a
``.tar.gz`` (``torch-model-archiver --archive-format tgz``: the files under one folder named
after the model) and an unarchived folder (``--archive-format no-archive``: a folder holding
``MAR-INF/MANIFEST.json`` beside the files).

The other two are packed into a .mar, so that a repository and a registration carry one form
only. They come from outside as much as a .mar does, and meet its rules
(:mod:`sluice.core.torchserve.archives`): only plain files and folders (no links), names
strictly inside, each once, the count and the sizes bounded, the bytes counted as they are
copied. A .tar.gz's entries are checked as their headers are read, before the stream is
inflated past them, and no single read of it may be larger than :data:`MAX_TAR_READ`:
:mod:`tarfile` reads a long name or a pax header whole, however long its header claims. As
in TorchServe, an archive or folder whose only entry is a folder holding the manifest
stands for that folder. The form is told by content, not by name: a zip, a gzip stream, a
folder.
"""

from __future__ import annotations

import gzip
import os
import shutil
import stat
import tarfile
import zipfile
import zlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Literal

from sluice.core.errors import InvalidConfig
from sluice.core.torchserve.archives import (
    MANIFEST,
    MarManifest,
    MemberCheck,
    UnpackLimits,
    bad_archive,
    member_parts,
    read_manifest,
)

Form = Literal["mar", "tgz", "folder"]
_MANIFEST_PARTS = tuple(MANIFEST.split("/"))
_CHUNK = 1 << 20
_DATE = (1980, 1, 1, 0, 0, 0)
"""The packed entries' time (zip's earliest): the same files pack to the same bytes."""
_DAMAGED = (tarfile.TarError, zlib.error, EOFError, OSError)
MAX_TAR_READ = 4 << 20
"""The most one read of a .tar.gz takes: a header block, a long name or pax header (a few
hundred bytes when real), or a chunk of a file (:data:`_CHUNK`)."""


_Opener = Callable[[], AbstractContextManager[IO[bytes]]]


@dataclass(frozen=True, slots=True)
class _Member:
    raw: str
    parts: tuple[str, ...]
    is_dir: bool
    size: int
    open: _Opener


def form_of(path: Path) -> Form:
    """Which form ``path`` is in; a refusal for anything else."""
    if path.is_dir():
        return "folder"
    try:
        with path.open("rb") as stream:
            head = stream.read(2)
    except OSError as exc:
        raise InvalidConfig(f"cannot read {path.name}: {exc.strerror or exc}") from None
    if head == b"PK":
        return "mar"
    if head == b"\x1f\x8b":
        return "tgz"
    raise bad_archive(path, "neither a .mar (zip) nor a .tar.gz archive")


def is_model_entry(path: Path) -> bool:
    """Whether an entry of a model store folder is a model: a .mar, .tar.gz or .tgz file,
    or a folder holding the manifest (itself, or its only subfolder)."""
    if path.is_file():
        return path.name.endswith((".mar", ".tar.gz", ".tgz"))
    if not path.is_dir() or path.is_symlink() or path.name.startswith("."):
        return False
    if (path / MANIFEST).is_file():
        return True
    entries = list(path.iterdir())
    return len(entries) == 1 and entries[0].is_dir() and (entries[0] / MANIFEST).is_file()


def pack(source: Path, target: Path, limits: UnpackLimits | None = None) -> MarManifest:
    """``source``, in any form, as the .mar ``target`` (a .mar is copied, the others are
    packed; nothing is left at ``target`` on failure); returns the manifest."""
    limits = limits or UnpackLimits()
    form = form_of(source)
    if form == "mar":
        manifest = read_manifest(source)
        shutil.copyfile(source, target)
        return manifest
    try:
        with target.open("wb") as sink:
            if form == "tgz":
                with _open_tar(source) as tar:
                    _write(source, _tar_members(source, tar, limits), sink, limits)
            else:
                _write(source, _folder_members(source, limits), sink, limits)
        return read_manifest(target)
    except BaseException:
        target.unlink(missing_ok=True)
        raise


class _BoundedReads:
    """A .tar.gz's inflated stream, each read at most :data:`MAX_TAR_READ` bytes."""

    def __init__(self, path: Path, stream: gzip.GzipFile) -> None:
        self.path, self.stream = path, stream

    def read(self, size: int = -1, /) -> bytes:
        if not 0 <= size <= MAX_TAR_READ:
            raise bad_archive(self.path, f"holds a header of more than {MAX_TAR_READ} bytes")
        return self.stream.read(size)

    def write(self, data: bytes, /) -> int:
        raise OSError("read only")

    def tell(self) -> int:
        return self.stream.tell()

    def seek(self, offset: int, whence: int = os.SEEK_SET, /) -> int:
        return self.stream.seek(offset, whence)

    def close(self) -> None:
        self.stream.close()


@contextmanager
def _open_tar(path: Path) -> Iterator[tarfile.TarFile]:
    with gzip.GzipFile(path, "rb") as stream, _tar(path, stream) as tar:
        yield tar


def _tar(path: Path, stream: gzip.GzipFile) -> tarfile.TarFile:
    try:
        return tarfile.open(fileobj=_BoundedReads(path, stream), mode="r:")
    except _DAMAGED as exc:
        raise bad_archive(path, f"not a readable .tar.gz archive ({exc})") from None


def _tar_members(path: Path, tar: tarfile.TarFile, limits: UnpackLimits) -> list[_Member]:
    """The members, each checked (its size too) as soon as its header is read: the next
    header is reached by inflating the member's bytes, which a bomb claims by the gigabyte."""
    members: list[_Member] = []
    check = MemberCheck(path, limits.entries, limits)
    try:
        for info in tar:
            raw = info.name
            while raw.startswith("./"):  # what `tar -C folder .` writes
                raw = raw[2:]
            if raw in ("", "."):
                continue
            if not (info.isreg() or info.isdir()):
                raise bad_archive(path, f"entry {info.name!r} is not a plain file or folder")
            parts = member_parts(path, raw, info.isdir())
            check.add(raw, parts, info.isdir(), info.size)
            members.append(_Member(raw, parts, info.isdir(), info.size, _tar_file(tar, info)))
    except _DAMAGED as exc:
        raise bad_archive(path, f"is damaged ({exc})") from None
    return members


def _tar_file(tar: tarfile.TarFile, info: tarfile.TarInfo) -> _Opener:
    def opener() -> AbstractContextManager[IO[bytes]]:
        stream = tar.extractfile(info)
        assert stream is not None  # a regular file's
        return stream

    return opener


def _file(path: Path) -> _Opener:
    return lambda: path.open("rb")


def _folder_members(root: Path, limits: UnpackLimits) -> list[_Member]:
    members: list[_Member] = []
    for entry in _walk(root):
        if len(members) >= limits.entries:
            raise bad_archive(root, f"more than {limits.entries} entries")
        raw = entry.relative_to(root).as_posix()
        mode = entry.lstat()
        if stat.S_ISLNK(mode.st_mode):
            raise bad_archive(root, f"entry {raw!r} is a link (copy the file in instead)")
        if not (stat.S_ISREG(mode.st_mode) or stat.S_ISDIR(mode.st_mode)):
            raise bad_archive(root, f"entry {raw!r} is not a plain file or folder")
        is_dir = stat.S_ISDIR(mode.st_mode)
        members.append(
            _Member(
                raw,
                member_parts(root, raw, is_dir),
                is_dir,
                mode.st_size,
                _file(entry),
            )
        )
    return members


def _walk(root: Path) -> Iterator[Path]:
    """Every entry under ``root``, in name order, without following links."""
    try:
        for folder, folders, files in os.walk(root, followlinks=False, onerror=_raise):
            folders.sort()
            for name in sorted([*folders, *files]):
                yield Path(folder) / name
    except OSError as exc:
        raise InvalidConfig(f"cannot read {root.name}: {exc.strerror or exc}") from None


def _raise(error: OSError) -> None:
    raise error


def _root(path: Path, members: list[_Member]) -> tuple[str, ...]:
    """The folder the model's files are in: the archive's own top, or its only folder."""
    files = {m.parts for m in members if not m.is_dir}
    if _MANIFEST_PARTS in files:
        return ()
    tops = {m.parts[0] for m in members}
    if len(tops) == 1:
        (top,) = tops
        if (top, *_MANIFEST_PARTS) in files:
            return (top,)
    raise bad_archive(path, f"{MANIFEST} is missing (not made by torch-model-archiver?)")


def _write(source: Path, members: list[_Member], sink: IO[bytes], limits: UnpackLimits) -> None:
    check = MemberCheck(source, limits.entries, limits)
    for member in members:
        check.add(member.raw, member.parts, member.is_dir, member.size)
    check.finish()
    root = _root(source, members)
    written = 0
    with zipfile.ZipFile(sink, "w", zipfile.ZIP_STORED) as out:
        for member in members:
            parts = member.parts[len(root) :]
            if not parts:
                continue  # the root folder itself
            name = "/".join(parts) + ("/" if member.is_dir else "")
            info = zipfile.ZipInfo(name, _DATE)
            mode = (stat.S_IFDIR | 0o755) if member.is_dir else (stat.S_IFREG | 0o644)
            info.external_attr = mode << 16 | (0x10 if member.is_dir else 0)
            if member.is_dir:
                out.writestr(info, b"")
                continue
            info.file_size = member.size
            written += _copy(source, member, out, info, limits, limits.total_bytes - written)


def _copy(
    source: Path,
    member: _Member,
    out: zipfile.ZipFile,
    info: zipfile.ZipInfo,
    limits: UnpackLimits,
    allowance: int,
) -> int:
    """Copy one file into the zip, counting: never beyond its claimed size, the entry bound
    or what the total bound leaves. Returns the bytes copied."""
    copied = 0
    try:
        with member.open() as stream, out.open(info, "w") as target:
            while chunk := stream.read(_CHUNK):
                copied += len(chunk)
                if copied > allowance:
                    raise bad_archive(source, f"unpacks to more than {limits.total_bytes} bytes")
                if copied > member.size:
                    raise bad_archive(source, f"entry {member.raw!r} changed while it was read")
                target.write(chunk)
    except _DAMAGED as exc:
        raise bad_archive(source, f"entry {member.raw!r} cannot be read ({exc})") from None
    return copied
