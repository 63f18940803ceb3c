"""TorchServe model archives (``.mar``, made by ``torch-model-archiver``): the manifest, read
without unpacking, and a safe unpacking.

An archive is a zip with ``MAR-INF/MANIFEST.json`` (``model.modelName``, ``model.handler``,
``model.serializedFile``, ``model.modelFile``, ``model.modelVersion``,
``model.requirementsFile``) beside the model's files. It comes from outside, so nothing in it
is trusted: member names that are absolute, climb with ``..``, or are links are refused;
the entry count is bounded; and the bytes written while unpacking are counted, not the
sizes the zip claims, so a compressed bomb stops at the limit.
"""

from __future__ import annotations

import json
import shutil
import stat
import zipfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from sluice.errors import InvalidConfig

MANIFEST = "MAR-INF/MANIFEST.json"
MAX_ENTRIES = 10_000
MAX_MANIFEST_BYTES = 1 << 20
_CHUNK = 1 << 20


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
    """The archive's manifest, checked; the archive's members are checked too."""
    with _open(path) as archive:
        _check_members(path, archive)
        try:
            info = archive.getinfo(MANIFEST)
        except KeyError:
            raise _bad(path, f"{MANIFEST} is missing (not made by torch-model-archiver?)") from None
        if info.file_size > MAX_MANIFEST_BYTES:
            raise _bad(path, f"{MANIFEST} is larger than {MAX_MANIFEST_BYTES} bytes")
        with archive.open(info) as stream:
            data = stream.read(MAX_MANIFEST_BYTES + 1)
    try:
        manifest = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
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


def _check_members(path: Path, archive: zipfile.ZipFile) -> list[zipfile.ZipInfo]:
    members = archive.infolist()
    if len(members) > MAX_ENTRIES:
        raise _bad(path, f"more than {MAX_ENTRIES} entries")
    seen: set[str] = set()
    for info in members:
        name = PurePosixPath(info.filename)
        if name.is_absolute() or ".." in name.parts or "\\" in info.filename:
            raise _bad(path, f"entry {info.filename!r} points outside the archive")
        kind = stat.S_IFMT(info.external_attr >> 16)  # 0: no Unix mode recorded
        if kind and kind not in (stat.S_IFREG, stat.S_IFDIR):
            raise _bad(path, f"entry {info.filename!r} is not a plain file or folder")
        key = str(name)
        if key in seen:
            raise _bad(path, f"entry {info.filename!r} appears twice")
        seen.add(key)
    return members


def unpack(path: Path, destination: Path, max_bytes: int) -> MarManifest:
    """Unpack ``path`` into ``destination`` (created; must not exist), writing at most
    ``max_bytes``; returns the manifest. On any failure nothing is left behind."""
    manifest = read_manifest(path)
    destination.mkdir(parents=True)
    try:
        written = 0
        with _open(path) as archive:
            for info in _check_members(path, archive):
                target = destination.joinpath(*PurePosixPath(info.filename).parts)
                if info.is_dir():
                    target.mkdir(parents=True, exist_ok=True)
                    continue
                target.parent.mkdir(parents=True, exist_ok=True)
                with archive.open(info) as source, target.open("xb") as sink:
                    while chunk := source.read(_CHUNK):
                        written += len(chunk)
                        if written > max_bytes:
                            raise _bad(path, f"unpacks to more than {max_bytes} bytes")
                        sink.write(chunk)
    except BaseException:
        shutil.rmtree(destination, ignore_errors=True)
        raise
    return manifest


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
