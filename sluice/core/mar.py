"""TorchServe model archives (``.mar``, made by ``torch-model-archiver``): the manifest, read
without unpacking, and a safe unpacking.

An archive is a zip with ``MAR-INF/MANIFEST.json`` (``model.modelName``, ``model.handler``,
``model.serializedFile``, ``model.modelFile``, ``model.modelVersion``,
``model.requirementsFile``) beside the model's files. It comes from outside, so nothing in it
is trusted: member names that are absolute, climb with ``..``, name the archive's own root
(``.``), hold empty parts or backslashes, clash with another member, or are links are
refused, as are encrypted members. Unpacking is bounded three ways (:class:`UnpackLimits`):
the entry count, each entry's size and the total size. The sizes are checked twice: from
the zip's central directory before anything is written, and again by counting the bytes
actually written, since the directory can lie; a compressed bomb stops at the limit either
way.
"""

from __future__ import annotations

import json
import shutil
import stat
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sluice.core.errors import InvalidConfig

MANIFEST = "MAR-INF/MANIFEST.json"
MAX_ENTRIES = 10_000
MAX_MANIFEST_BYTES = 1 << 20
MAX_UNPACKED_BYTES = 4 << 30
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


def _bad(path: Path, reason: str) -> InvalidConfig:
    return InvalidConfig(f"model archive {path.name}: {reason}")


def _open(path: Path) -> zipfile.ZipFile:
    try:
        return zipfile.ZipFile(path)
    except (OSError, zipfile.BadZipFile) as exc:
        raise _bad(path, f"not a readable zip archive ({exc})") from None


def _text(value: Any, field: str, path: Path, *, required: bool = False) -> str:
    if value is None and not required:
        return ""
    if not isinstance(value, str) or (required and not value.strip()):
        raise _bad(path, f"manifest field 'model.{field}' must be a non-empty string")
    return value


def read_manifest(path: Path) -> MarManifest:
    """The archive's manifest, checked; the archive's members are checked too (names and
    count; sizes only when unpacking, against the unpacker's limits)."""
    with _open(path) as archive:
        _check_members(path, archive, MAX_ENTRIES)
        return _manifest(path, archive)


def _manifest(path: Path, archive: zipfile.ZipFile) -> MarManifest:
    try:
        info = archive.getinfo(MANIFEST)
    except KeyError:
        raise _bad(path, f"{MANIFEST} is missing (not made by torch-model-archiver?)") from None
    if info.file_size > MAX_MANIFEST_BYTES:
        raise _bad(path, f"{MANIFEST} is larger than {MAX_MANIFEST_BYTES} bytes")
    try:
        with archive.open(info) as stream:
            data = stream.read(MAX_MANIFEST_BYTES + 1)
    except _DAMAGED as exc:
        raise _bad(path, f"{MANIFEST} is damaged ({exc})") from None
    try:
        manifest = json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise _bad(path, f"{MANIFEST} is not JSON ({exc})") from None
    model = manifest.get("model") if isinstance(manifest, dict) else None
    if not isinstance(model, dict):
        raise _bad(path, f"{MANIFEST} has no 'model' object")
    return MarManifest(
        model_name=_text(model.get("modelName"), "modelName", path, required=True),
        handler=_text(model.get("handler"), "handler", path, required=True),
        serialized_file=_text(model.get("serializedFile"), "serializedFile", path),
        model_file=_text(model.get("modelFile"), "modelFile", path),
        version=_text(model.get("modelVersion"), "modelVersion", path) or "1.0",
        requirements_file=_text(model.get("requirementsFile"), "requirementsFile", path),
        raw=manifest,
    )


def _parts(path: Path, info: zipfile.ZipInfo) -> tuple[str, ...]:
    """The member's path inside the archive, part by part, or a refusal: a member must
    name a file or folder strictly inside the archive, in exactly one spelling."""
    raw = info.filename
    if raw.startswith("/") or "\\" in raw:
        raise _bad(path, f"entry {raw!r} points outside the archive")
    parts = raw.split("/")
    if info.is_dir():
        parts = parts[:-1]  # the trailing slash of a folder
    if ".." in parts:
        raise _bad(path, f"entry {raw!r} points outside the archive")
    if not parts or any(part in ("", ".") or "\0" in part for part in parts):
        raise _bad(path, f"entry {raw!r} does not name a file or folder inside the archive")
    return tuple(parts)


def _check_members(
    path: Path, archive: zipfile.ZipFile, max_entries: int, limits: UnpackLimits | None = None
) -> list[tuple[zipfile.ZipInfo, tuple[str, ...]]]:
    """Every member with its path, once each is found acceptable; with ``limits``, the
    sizes the central directory claims are checked against them too."""
    members = archive.infolist()
    if len(members) > max_entries:
        raise _bad(path, f"more than {max_entries} entries")
    checked: list[tuple[zipfile.ZipInfo, tuple[str, ...]]] = []
    files: set[tuple[str, ...]] = set()
    folders: set[tuple[str, ...]] = set()
    claimed = 0
    for info in members:
        parts = _parts(path, info)
        kind = stat.S_IFMT(info.external_attr >> 16)  # 0: no Unix mode recorded
        if kind and kind not in (stat.S_IFREG, stat.S_IFDIR):
            raise _bad(path, f"entry {info.filename!r} is not a plain file or folder")
        if info.flag_bits & 0x1:
            raise _bad(path, f"entry {info.filename!r} is encrypted")
        if parts in files or (info.is_dir() and parts in folders):
            raise _bad(path, f"entry {info.filename!r} appears twice")
        (folders if info.is_dir() else files).add(parts)
        folders.update(parts[:end] for end in range(1, len(parts)))
        if limits is not None and not info.is_dir():
            claimed += info.file_size
            if claimed > limits.total_bytes:
                raise _bad(
                    path,
                    f"unpacks to more than {limits.total_bytes} bytes (by its directory)",
                )
            if info.file_size > limits.largest_entry:
                raise _bad(
                    path,
                    f"entry {info.filename!r} unpacks to more than {limits.largest_entry} bytes",
                )
        checked.append((info, parts))
    clash = sorted(files & folders)
    if clash:
        raise _bad(path, f"entry {'/'.join(clash[0])!r} is both a file and a folder")
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
    with _open(path) as archive:
        members = _check_members(path, archive, limits.entries, limits)
        manifest = _manifest(path, archive)
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
                    raise _bad(
                        path,
                        f"unpacks to more than {limits.total_bytes} bytes",
                    )
                if written > limits.largest_entry:
                    raise _bad(
                        path,
                        f"entry {info.filename!r} unpacks to more than "
                        f"{limits.largest_entry} bytes",
                    )
                if written > info.file_size:
                    raise _bad(
                        path,
                        f"entry {info.filename!r} holds more than the {info.file_size} bytes "
                        "its directory claims",
                    )
                sink.write(chunk)
    except _DAMAGED as exc:
        raise _bad(path, f"entry {info.filename!r} is damaged ({exc})") from None
    except (FileExistsError, IsADirectoryError, NotADirectoryError):
        raise _bad(path, f"entry {info.filename!r} clashes with another entry") from None
    return written


def triton_config(
    name: str,
    batch_size: int = 1,
    max_batch_delay_ms: int = 100,
    *,
    workers: int = 1,
    queue_size: int = 0,
    response_timeout_s: int = 0,
) -> str:
    """config.pbtxt for an archive served as ``<name>/1/model.mar``, from TorchServe's
    settings: ``batch_size`` and ``max_batch_delay`` (milliseconds) become ``max_batch_size``
    and the dynamic batcher's window, ``workers`` the instance count, ``queue_size`` (0: the
    server's default) the queue's bound, ``response_timeout_s`` (0: the server's default) the
    requests' deadline. The tensors are those of the ``torchserve`` backend."""
    for value, what in (
        (batch_size, "batchSize"),
        (workers, "minWorkers"),
    ):
        if not isinstance(value, int) or value < 1:
            raise InvalidConfig(f"model '{name}': {what} must be a whole number of at least 1")
    for value, what in (
        (max_batch_delay_ms, "maxBatchDelay"),
        (queue_size, "job_queue_size"),
        (response_timeout_s, "responseTimeout"),
    ):
        if not isinstance(value, int) or value < 0:
            raise InvalidConfig(f"model '{name}': {what} must be a whole number of at least 0")
    tensor = '{{ name: "{}" data_type: TYPE_STRING dims: [ 1 ] }}'
    policy = ""
    if queue_size or response_timeout_s:
        policy = (
            f"  default_queue_policy {{ max_queue_size: {queue_size} "
            f"default_timeout_microseconds: {response_timeout_s * 1_000_000} }}\n"
        )
    return (
        f'name: "{name}"\nbackend: "torchserve"\nmax_batch_size: {batch_size}\n'
        f"input [ {tensor.format('body')}, {tensor.format('content_type')} ]\n"
        f"output [ {tensor.format('response')}, {tensor.format('response_type')} ]\n"
        f"instance_group [ {{ count: {workers} kind: KIND_CPU }} ]\n"
        f"dynamic_batching {{\n  max_queue_delay_microseconds: {max_batch_delay_ms * 1000}\n"
        f"{policy}}}\n"
    )
