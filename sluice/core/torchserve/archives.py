"""TorchServe model archives (``.mar``, made by ``torch-model-archiver``): the manifest, read
without unpacking, and a safe unpacking.

An archive is a zip with ``MAR-INF/MANIFEST.json`` (``model.modelName``, ``model.handler``,
``model.serializedFile``, ``model.modelFile``, ``model.modelVersion``,
``model.requirementsFile``, ``model.configFile``) beside the model's files. (A model store's
other forms, ``.tar.gz`` archives and unarchived folders, are packed into one:
:mod:`sluice.core.torchserve.forms`.) It comes from outside, so nothing in it
is trusted: member names that are absolute, climb with ``..``, name the archive's own root
(``.``), hold empty parts or backslashes, are longer than a path can be (a part beyond 255
bytes, a name beyond 1024), clash with another member, or are links are refused, as are
encrypted members. The entry count is bounded before :mod:`zipfile` reads the central
directory (it makes an object of every record there, whatever the count, so a small archive
of millions of records would hold the process for minutes and gigabytes). Unpacking is
bounded three ways (:class:`UnpackLimits`): the entry count, each entry's size and the total
size. The sizes are checked twice: from the zip's central directory before anything is
written, and again by counting the bytes actually written, since the directory can lie; a
compressed bomb stops at the limit either way.
"""

from __future__ import annotations

import json
import shutil
import stat
import struct
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from sluice.core.errors import InvalidConfig
from sluice.core.torchserve.config import triton_config as triton_config  # (its old home)

MANIFEST = "MAR-INF/MANIFEST.json"
RUNTIMES = ("python", "python3")
"""The runtimes TorchServe knows (its manifest's ``RuntimeType``)."""
NO_RUNTIME = "Runtime is not defined or invalid."
"""TorchServe's 400 for a manifest whose ``runtime`` it does not know."""
MAX_ENTRIES = 10_000
MAX_MANIFEST_BYTES = 1 << 20
MAX_UNPACKED_BYTES = 4 << 30
MAX_NAME_BYTES = 1024
"""The longest member name (its path inside the archive, in UTF-8): with the folder it is
unpacked into, a path the file system takes."""
MAX_PART_BYTES = 255
"""The longest part of a member's name (a file or folder name on Linux)."""
"""Bound on what one archive unpacks to (4 GiB; a larger model is served from its files,
not from an archive)."""
_CHUNK = 1 << 20
_DAMAGED = (zipfile.BadZipFile, zlib.error, EOFError, NotImplementedError, RuntimeError)
"""What reading a member of a damaged (or lying) archive raises: a bad CRC, a short or
corrupt stream, an unknown compression method, a password."""


@dataclass(frozen=True, slots=True)
class UnpackLimits:
    """How much one archive may unpack to."""

    total_bytes: int = MAX_UNPACKED_BYTES
    entries: int = MAX_ENTRIES
    entry_bytes: int | None = None
    """Largest single entry; None: ``total_bytes``."""

    @property
    def largest_entry(self) -> int:
        return self.total_bytes if self.entry_bytes is None else self.entry_bytes


@dataclass(frozen=True, slots=True)
class MarManifest:
    model_name: str
    handler: str
    """A handler file in the archive (``handler.py``, optionally ``:function``) or a
    TorchServe built-in handler's name (``image_classifier``, ...)."""
    serialized_file: str
    model_file: str
    version: str
    requirements_file: str
    """Reported, never installed: the operator installs what a handler needs."""
    raw: dict[str, Any]
    config_file: str = ""
    """TorchServe's per-model configuration in the archive (``model-config.yaml``, from
    ``torch-model-archiver --config-file``): :mod:`sluice.core.torchserve.settings`."""
    runtime: str = "python"
    """The manifest's top-level ``runtime`` (one of :data:`RUNTIMES`), TorchServe's default
    ``python`` where it names none; empty where it names one TorchServe does not know
    (``null``, ``java``), which a registration refuses (:func:`registered_runtime`)."""


def bad_archive(path: Path, reason: str) -> InvalidConfig:
    return InvalidConfig(f"model archive {path.name}: {reason}")


def _open(path: Path, max_entries: int = MAX_ENTRIES) -> zipfile.ZipFile:
    """The archive, open, once its central directory is found to hold at most
    ``max_entries`` records."""
    try:
        with path.open("rb") as stream:
            _count_records(path, stream, max_entries)
        return zipfile.ZipFile(path)
    except (OSError, zipfile.BadZipFile) as exc:
        raise bad_archive(path, f"not a readable zip archive ({exc})") from None


_END = struct.Struct("<4s4H2LH")
"""The end of central directory record (its size field is the sixth)."""
_END_SIGNATURE = b"PK\x05\x06"
_END64_LOCATOR_SIZE, _END64_SIZE = 20, 56
_RECORD = struct.Struct("<4s42x")
"""A central directory record's fixed part (its name, extra and comment lengths at 28)."""


def _count_records(path: Path, stream: IO[bytes], max_entries: int) -> None:
    """Refuse an archive whose central directory holds more than ``max_entries`` records,
    walking their fixed parts only, where :mod:`zipfile` will read them (the end record, or
    its Zip64 form, says where). What :mod:`zipfile` refuses anyway (no end record, a
    directory that does not parse) is left to it."""
    size = stream.seek(0, 2)
    tail_size = min(size, _END.size + (1 << 16))  # the record, and a comment up to 64 KiB
    stream.seek(size - tail_size)
    tail = stream.read(tail_size)
    at = tail_size - _END.size  # a record without a comment, as zipfile looks first
    if at < 0 or tail[at : at + 4] != _END_SIGNATURE or tail[-2:] != b"\0\0":
        at = tail.rfind(_END_SIGNATURE)
    if at < 0 or tail_size - at < _END.size:
        return
    directory_size: int = _END.unpack_from(tail, at)[5]
    end = size - tail_size + at
    if end >= _END64_LOCATOR_SIZE + _END64_SIZE:
        stream.seek(end - _END64_LOCATOR_SIZE - _END64_SIZE)
        zip64 = stream.read(_END64_SIZE + 4)
        if zip64[:4] == b"PK\x06\x06" and zip64[_END64_SIZE:] == b"PK\x06\x07":
            (directory_size,) = struct.unpack_from("<Q", zip64, 40)
            end -= _END64_LOCATOR_SIZE + _END64_SIZE
    start = end - directory_size
    walked, count = 0, 0
    while start >= 0 and walked < directory_size:
        stream.seek(start + walked)
        record = stream.read(_RECORD.size)
        if len(record) < _RECORD.size or record[:4] != b"PK\x01\x02":
            return
        count += 1
        if count > max_entries:
            raise bad_archive(path, f"more than {max_entries} entries")
        walked += _RECORD.size + sum(struct.unpack_from("<3H", record, 28))


def _text(value: Any, field: str, path: Path, *, required: bool = False) -> str:
    if value is None and not required:
        return ""
    if not isinstance(value, str) or (required and not value.strip()):
        raise bad_archive(path, f"manifest field 'model.{field}' must be a non-empty string")
    return value


def read_manifest(path: Path) -> MarManifest:
    """The archive's manifest, checked; the archive's members are checked too (names and
    count; sizes only when unpacking, against the unpacker's limits)."""
    with _open(path) as archive:
        _check_members(path, archive, MAX_ENTRIES)
        return _manifest(path, archive)


def _manifest(path: Path, archive: zipfile.ZipFile, *, registering: bool = True) -> MarManifest:
    missing = f"{MANIFEST} is missing (not made by torch-model-archiver?)"
    data = _member(path, archive, MANIFEST, MAX_MANIFEST_BYTES, missing)
    return _parse_manifest(path, data, registering=registering)


def _member(path: Path, archive: zipfile.ZipFile, name: str, max_bytes: int, missing: str) -> bytes:
    """The file ``name`` of the open archive at ``path``, at most ``max_bytes`` (read no
    further), or :func:`bad_archive` saying ``missing`` when it is not there."""
    try:
        info = archive.getinfo(name)
    except KeyError:
        raise bad_archive(path, missing) from None
    if info.is_dir() or info.file_size > max_bytes:
        raise bad_archive(path, f"{name} is not a file of at most {max_bytes} bytes")
    try:
        with archive.open(info) as stream:
            data = stream.read(max_bytes + 1)
    except _DAMAGED as exc:
        raise bad_archive(path, f"{name} is damaged ({exc})") from None
    if len(data) > max_bytes:
        raise bad_archive(path, f"{name} is not a file of at most {max_bytes} bytes")
    return data


def _parse_manifest(path: Path, data: bytes, *, registering: bool = True) -> MarManifest:
    """The manifest of the archive at ``path`` (named in errors), from its bytes.
    ``registering``: read as TorchServe reads it when it registers the archive (its version
    required); else as a worker unpacks one already laid out, whose version is its folder's
    (an archive laid out by hand without one serves as ``1.0``)."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise bad_archive(path, f"{MANIFEST} is larger than {MAX_MANIFEST_BYTES} bytes")
    try:
        manifest = json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise bad_archive(path, f"{MANIFEST} is not JSON ({exc})") from None
    model = manifest.get("model") if isinstance(manifest, dict) else None
    if not isinstance(model, dict):
        raise bad_archive(path, f"{MANIFEST} has no 'model' object")
    return MarManifest(
        model_name=_text(model.get("modelName"), "modelName", path, required=True),
        handler=_text(model.get("handler"), "handler", path, required=True),
        serialized_file=_text(model.get("serializedFile"), "serializedFile", path),
        model_file=_text(model.get("modelFile"), "modelFile", path),
        version=_version(path, data, model.get("modelVersion"), registering),
        requirements_file=_text(model.get("requirementsFile"), "requirementsFile", path),
        raw=manifest,
        config_file=_text(model.get("configFile"), "configFile", path),
        runtime=_runtime(manifest),
    )


def _runtime(manifest: dict[str, Any]) -> str:
    """The manifest's ``runtime`` as TorchServe reads it (Gson, into a manifest whose
    runtime is ``python`` until read): absent, ``python``; a value it does not know, or
    ``null``, none (empty)."""
    value = manifest.get("runtime", "python")
    return value if isinstance(value, str) and value in RUNTIMES else ""


def registered_runtime(manifest: MarManifest, asked: str | None, archive: str) -> str:
    """The runtime a registration gives the model: the one ``asked`` (the registration's
    ``runtime`` parameter, which TorchServe sets before it checks the manifest), else the
    manifest's; TorchServe's 400 ``Runtime is not defined or invalid.`` when neither names
    one. Only a registration checks it: a worker serves an archive laid out by hand
    whatever its manifest's runtime."""
    runtime = asked or manifest.runtime
    if not runtime:
        raise InvalidConfig(f"model archive {archive}: {NO_RUNTIME}")
    return runtime


def _version(path: Path, data: bytes, value: Any, registering: bool) -> str:
    """The manifest's ``modelVersion`` (its JSON ``data`` held for a number's text), read as
    TorchServe reads it: required (its 400 ``Model version is not defined.``), a number or a
    boolean taken as its JSON text (``2``, ``1.50``, ``true``). An empty text, which
    TorchServe takes, is refused: no version URL could name it."""
    if not registering and value in (None, ""):
        return "1.0"
    if value is None:
        raise bad_archive(path, "Model version is not defined.")
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        # Again, with each number kept as its text (a hand-made manifest only).
        value = json.loads(data, parse_int=str, parse_float=str)["model"]["modelVersion"]
    if not isinstance(value, str):
        raise bad_archive(path, "manifest field 'model.modelVersion' must be a string")
    if not value:
        raise bad_archive(
            path, "manifest field 'model.modelVersion' is empty: no URL could name the version"
        )
    return value


def read_member(path: Path, name: str, max_bytes: int) -> bytes:
    """One file of the archive (a manifest's ``configFile``), at most ``max_bytes``."""
    missing = f"the manifest names {name!r}, which the archive does not hold"
    with _open(path) as archive:
        return _member(path, archive, name, max_bytes, missing)


def read_small_archive(path: Path, limits: UnpackLimits) -> dict[str, bytes]:
    """Every file of a small archive (a workflow archive), by its ``/``-separated path, with
    the same checks as :func:`unpack` and within ``limits``."""
    files: dict[str, bytes] = {}
    with _open(path, limits.entries) as archive:
        left = limits.total_bytes
        for info, parts in _check_members(path, archive, limits.entries, limits):
            if info.is_dir():
                continue
            name = "/".join(parts)
            missing = f"entry {name!r} cannot be read"
            data = _member(path, archive, info.filename, min(left, limits.largest_entry), missing)
            left -= len(data)
            files[name] = data
    return files


def member_parts(path: Path, raw: str, is_dir: bool) -> tuple[str, ...]:
    """A member's path inside the archive (``raw``: its name, ``/``-separated; a folder's
    may end in ``/``), part by part, or a refusal: a member must name a file or folder
    strictly inside the archive, in exactly one spelling."""
    if raw.startswith("/") or "\\" in raw:
        raise bad_archive(path, f"entry {raw!r} points outside the archive")
    parts = raw.split("/")
    if is_dir and raw.endswith("/"):
        parts = parts[:-1]  # the trailing slash of a folder
    if ".." in parts:
        raise bad_archive(path, f"entry {raw!r} points outside the archive")
    if not parts or any(part in ("", ".") or "\0" in part for part in parts):
        raise bad_archive(path, f"entry {raw!r} does not name a file or folder inside the archive")
    if len(raw.encode(errors="surrogateescape")) > MAX_NAME_BYTES or any(
        len(part.encode(errors="surrogateescape")) > MAX_PART_BYTES for part in parts
    ):
        shown = raw if len(raw) <= 80 else raw[:80] + "..."
        raise bad_archive(
            path,
            f"entry {shown!r} has a name longer than {MAX_NAME_BYTES} bytes, or a part "
            f"longer than {MAX_PART_BYTES}",
        )
    return tuple(parts)


class MemberCheck:
    """The rules every member of an archive meets, whatever its form: counted, each name
    once (a file is never also a folder), and, with ``limits``, the sizes claimed bounded."""

    def __init__(self, path: Path, max_entries: int, limits: UnpackLimits | None = None) -> None:
        self.path, self.max_entries, self.limits = path, max_entries, limits
        self.files: set[tuple[str, ...]] = set()
        self.folders: set[tuple[str, ...]] = set()
        self.count = 0
        self.claimed = 0

    def add(self, raw: str, parts: tuple[str, ...], is_dir: bool, size: int) -> None:
        self.count += 1
        if self.count > self.max_entries:
            raise bad_archive(self.path, f"more than {self.max_entries} entries")
        if parts in self.files or (is_dir and parts in self.folders):
            raise bad_archive(self.path, f"entry {raw!r} appears twice")
        (self.folders if is_dir else self.files).add(parts)
        self.folders.update(parts[:end] for end in range(1, len(parts)))
        limits = self.limits
        if limits is not None and not is_dir:
            self.claimed += size
            if self.claimed > limits.total_bytes:
                raise bad_archive(
                    self.path,
                    f"unpacks to more than {limits.total_bytes} bytes (by its directory)",
                )
            if size > limits.largest_entry:
                raise bad_archive(
                    self.path, f"entry {raw!r} unpacks to more than {limits.largest_entry} bytes"
                )

    def finish(self) -> None:
        clash = sorted(self.files & self.folders)
        if clash:
            raise bad_archive(
                self.path, f"entry {'/'.join(clash[0])!r} is both a file and a folder"
            )


def _check_members(
    path: Path, archive: zipfile.ZipFile, max_entries: int, limits: UnpackLimits | None = None
) -> list[tuple[zipfile.ZipInfo, tuple[str, ...]]]:
    """Every member with its path, once each is found acceptable; with ``limits``, the
    sizes the central directory claims are checked against them too."""
    members = archive.infolist()
    if len(members) > max_entries:
        raise bad_archive(path, f"more than {max_entries} entries")
    check = MemberCheck(path, max_entries, limits)
    checked: list[tuple[zipfile.ZipInfo, tuple[str, ...]]] = []
    for info in members:
        parts = member_parts(path, info.filename, info.is_dir())
        kind = stat.S_IFMT(info.external_attr >> 16)  # 0: no Unix mode recorded
        if kind and kind not in (stat.S_IFREG, stat.S_IFDIR):
            raise bad_archive(path, f"entry {info.filename!r} is not a plain file or folder")
        if info.flag_bits & 0x1:
            raise bad_archive(path, f"entry {info.filename!r} is encrypted")
        check.add(info.filename, parts, info.is_dir(), info.file_size)
        checked.append((info, parts))
    check.finish()
    return checked


def unpack(
    path: Path,
    destination: Path,
    max_bytes: int = MAX_UNPACKED_BYTES,
    *,
    limits: UnpackLimits | None = None,
) -> MarManifest:
    """Unpack ``path`` into ``destination`` (created; must not exist), writing at most
    ``max_bytes`` (or what ``limits`` allow); returns the manifest. On any failure nothing
    is left behind."""
    limits = limits or UnpackLimits(total_bytes=max_bytes)
    with _open(path, limits.entries) as archive:
        members = _check_members(path, archive, limits.entries, limits)
        manifest = _manifest(path, archive, registering=False)
        destination.mkdir(parents=True)
        try:
            written = 0
            for info, parts in members:
                target = destination.joinpath(*parts)
                if info.is_dir():
                    target.mkdir(parents=True, exist_ok=True)
                    continue
                target.parent.mkdir(parents=True, exist_ok=True)
                written += _write(path, archive, info, target, limits, limits.total_bytes - written)
        except BaseException:
            shutil.rmtree(destination, ignore_errors=True)
            raise
    return manifest


def _write(
    path: Path,
    archive: zipfile.ZipFile,
    info: zipfile.ZipInfo,
    target: Path,
    limits: UnpackLimits,
    allowance: int,
) -> int:
    """Copy one member to ``target``, counting what is written: beyond what the directory
    claimed for it, beyond the entry bound or beyond ``allowance`` (what the total bound
    leaves) it stops. Returns the bytes written."""
    written = 0
    try:
        with archive.open(info) as source, target.open("xb") as sink:
            while chunk := source.read(_CHUNK):
                written += len(chunk)
                if written > allowance:
                    raise bad_archive(
                        path,
                        f"unpacks to more than {limits.total_bytes} bytes",
                    )
                if written > limits.largest_entry:
                    raise bad_archive(
                        path,
                        f"entry {info.filename!r} unpacks to more than "
                        f"{limits.largest_entry} bytes",
                    )
                if written > info.file_size:
                    raise bad_archive(
                        path,
                        f"entry {info.filename!r} holds more than the {info.file_size} bytes "
                        "its directory claims",
                    )
                sink.write(chunk)
    except _DAMAGED as exc:
        raise bad_archive(path, f"entry {info.filename!r} is damaged ({exc})") from None
    except (FileExistsError, IsADirectoryError, NotADirectoryError):
        raise bad_archive(path, f"entry {info.filename!r} clashes with another entry") from None
    return written
