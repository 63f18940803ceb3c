"""What a remote store's flat object listing holds as a repository: keys checked, each
model's files sorted into its versions and the files beside them, and a version taken only
when complete and within the limits.

Completeness is decided by a manifest written last, ``<model>/<version>/.sluice-manifest.json``,
naming every file of the version folder with its size and SHA-256. A version is taken only
when the objects listed under its folder are exactly the manifest's, with the manifest's
sizes; the downloaded bytes must then match the checksums (checked by the cache). S3 has
no multi-object transaction, and upload tools (``aws s3 sync``) write in any order, so a
bare marker object could be listed before the files it vouches for, and it would say
nothing when a version is overwritten in place; a half upload cannot satisfy a manifest.
Files beside the versions (``config.pbtxt``, label files, ``warmup/``) are single objects,
which S3 replaces atomically: they are taken as listed, and a change to one counts as a
change of every version of the model (it is part of each version's token).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from sluice.scheduler.repository.sources import (
    VERSION_DIR,
    Entry,
    Listing,
    Model,
    SourceError,
    Version,
    key_problem,
    path_conflict,
    show,
    version_token,
)

MANIFEST_NAME = ".sluice-manifest.json"
RESERVED_PREFIX = ".sluice-"
"""Names Sluice writes itself (the manifest; the cache's bookkeeping): refused elsewhere."""
MAX_MANIFEST_BYTES = 1 << 20
_SHA256 = re.compile(r"[0-9a-f]{64}")


def build_manifest(version_dir: Path) -> bytes:
    """The manifest of a local version folder, to upload after its files."""
    files: dict[str, dict[str, int | str]] = {}
    for path in sorted(p for p in version_dir.rglob("*") if p.is_file()):
        relative = path.relative_to(version_dir).as_posix()
        if relative == MANIFEST_NAME:
            continue
        digest = hashlib.sha256()
        with path.open("rb") as stream:
            for chunk in iter(lambda: stream.read(1 << 20), b""):
                digest.update(chunk)
        files[relative] = {"size": path.stat().st_size, "sha256": digest.hexdigest()}
    return json.dumps({"sluice_manifest": 1, "files": files}, indent=1).encode() + b"\n"


def parse_manifest(data: bytes, where: str) -> dict[str, tuple[int, str]]:
    """``{path in the version folder: (size, sha256)}``; SourceError naming ``where``."""

    def bad(reason: str) -> SourceError:
        return SourceError(f"{where}: not a usable manifest: {reason}")

    if len(data) > MAX_MANIFEST_BYTES:
        raise bad(f"larger than {MAX_MANIFEST_BYTES} bytes")
    try:
        document = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad(f"invalid JSON ({exc})") from None
    if not isinstance(document, dict) or document.get("sluice_manifest") != 1:
        raise bad('expected {"sluice_manifest": 1, "files": {...}}')
    files = document.get("files")
    if not isinstance(files, dict):
        raise bad('"files" is not an object')
    result: dict[str, tuple[int, str]] = {}
    for path, spec in files.items():
        problem = key_problem(path) or _reserved(path)
        if problem is not None:
            raise bad(f"file {show(path)}: {problem}")
        size = spec.get("size") if isinstance(spec, dict) else None
        sha256 = spec.get("sha256") if isinstance(spec, dict) else None
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise bad(f"file {show(path)}: size is not a non-negative integer")
        if not isinstance(sha256, str) or not _SHA256.fullmatch(sha256):
            raise bad(f"file {show(path)}: sha256 is not 64 lowercase hex digits")
        result[path] = (size, sha256)
    return result


def _reserved(path: str) -> str | None:
    if any(part.startswith(RESERVED_PREFIX) for part in path.split("/")):
        return f"names starting with {RESERVED_PREFIX!r} are reserved for Sluice"
    return None


@dataclass(frozen=True, slots=True)
class RemoteObject:
    path: str
    """Relative to the repository prefix: ``model/1/model.onnx``."""
    size: int
    token: str


@dataclass(frozen=True, slots=True)
class Limits:
    max_object_bytes: int
    max_version_bytes: int


ReadManifest = Callable[[RemoteObject], bytes]
"""Reads one manifest object (given with its path relative to the repository prefix)."""


def assemble(
    objects: Iterable[RemoteObject],
    read_manifest: ReadManifest,
    limits: Limits,
    where: Callable[[str], str],
) -> Listing:
    """A remote store's flat object list as a Listing: keys checked, versions taken only
    when complete and within the limits. ``where`` turns a relative path into the full key
    for messages (``s3://bucket/prefix/...``)."""
    by_model: dict[str, list[RemoteObject]] = {}
    refused: dict[str, str] = {}
    ignored: list[str] = []
    for obj in objects:
        if obj.path.endswith("/") and obj.size == 0:
            continue  # a "folder" placeholder some tools create
        head, slash, _ = obj.path.partition("/")
        problem = key_problem(obj.path)
        if problem is not None:
            message = f"refused key {show(where(obj.path))}: {problem}"
            if slash and key_problem(head) is None and not head.startswith("."):
                refused.setdefault(head, message)
            else:
                ignored.append(message)
        elif slash and not head.startswith("."):  # hidden models are skipped, as locally
            by_model.setdefault(head, []).append(obj)
    assembler = _Assembler(read_manifest, limits, where)
    models: dict[str, Model] = {}
    for name, found in sorted(by_model.items()):
        if name in refused:
            continue
        try:
            models[name] = assembler.model(name, found)
        except SourceError as exc:
            refused[name] = exc.message
    return Listing(models, dict(sorted(refused.items())), tuple(ignored))


@dataclass(frozen=True, slots=True)
class _Assembler:
    read_manifest: ReadManifest
    limits: Limits
    where: Callable[[str], str]

    def model(self, name: str, objects: list[RemoteObject]) -> Model:
        """One model's objects: its files beside the versions, and each version either
        complete or not taken with the reason. SourceError refuses the whole model."""
        shared: list[Entry] = []
        files: dict[int, dict[str, RemoteObject]] = {}
        manifests: dict[int, RemoteObject] = {}
        for obj in objects:
            path = obj.path[len(name) + 1 :]
            first, slash, rest = path.partition("/")
            version_file = bool(slash) and first.isdigit()
            if version_file and not VERSION_DIR.fullmatch(first):
                continue  # "0/", "01/": not a version folder for Triton either
            if version_file and rest == MANIFEST_NAME:
                manifests[int(first)] = obj
                continue
            reserved = _reserved(path)
            if reserved is not None:
                raise SourceError(f"refused key {show(self.where(obj.path))}: {reserved}")
            if version_file:
                files.setdefault(int(first), {})[rest] = obj
            else:
                self._check_size(obj)
                shared.append(Entry(path, obj.size, obj.token))
        every_path = [e.path for e in shared] + [f"{v}/{p}" for v, fs in files.items() for p in fs]
        clash = path_conflict(every_path)
        if clash is not None:
            raise SourceError(f"{show(self.where(f'{name}/{clash}'))} is both a file and a folder")
        shared.sort(key=lambda e: e.path)
        versions: dict[int, Version] = {}
        not_taken: dict[int, str] = {}
        for version in sorted(set(files) | set(manifests)):
            found = files.get(version, {})
            try:
                entries = self._version(version, found, manifests.get(version), shared)
            except SourceError as exc:
                not_taken[version] = exc.message
                continue
            versions[version] = Version(entries, version_token(shared, entries))
        return Model(tuple(shared), versions, not_taken)

    def _version(
        self,
        version: int,
        files: dict[str, RemoteObject],
        manifest_object: RemoteObject | None,
        shared: list[Entry],
    ) -> tuple[Entry, ...]:
        """The entries of a complete version; SourceError with the reason otherwise."""
        if manifest_object is None:
            raise SourceError(f"incomplete: no {MANIFEST_NAME} yet (it is uploaded last)")
        folder = manifest_object.path[: -len(MANIFEST_NAME)]
        for _, obj in sorted(files.items()):
            self._check_size(obj)
        if manifest_object.size > MAX_MANIFEST_BYTES:
            raise SourceError(
                f"{show(self.where(manifest_object.path))} is larger than {MAX_MANIFEST_BYTES} "
                "bytes"
            )
        where_manifest = show(self.where(manifest_object.path))
        manifest = parse_manifest(self.read_manifest(manifest_object), where_manifest)
        missing = sorted(p for p in manifest if p not in files or files[p].size != manifest[p][0])
        extra = sorted(p for p in files if p not in manifest)
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise SourceError(
                f"incomplete: {show(self.where(folder + missing[0]))} is missing or not the "
                f"size the manifest says{more}"
            )
        if extra:
            raise SourceError(
                f"incomplete: {show(self.where(folder + extra[0]))} is not in the manifest (an "
                "upload in progress, or a manifest not rewritten after a change)"
            )
        total = sum(obj.size for obj in files.values()) + sum(e.size for e in shared)
        if total > self.limits.max_version_bytes:
            raise SourceError(
                f"{total} bytes with the model's own files, over the limit of "
                f"{self.limits.max_version_bytes} (SLUICE_S3_MAX_VERSION_BYTES)"
            )
        return tuple(
            Entry(f"{version}/{path}", obj.size, obj.token, manifest[path][1])
            for path, obj in sorted(files.items())
        )

    def _check_size(self, obj: RemoteObject) -> None:
        if obj.size > self.limits.max_object_bytes:
            raise SourceError(
                f"{show(self.where(obj.path))} is {obj.size} bytes, over the limit of "
                f"{self.limits.max_object_bytes} (SLUICE_S3_MAX_OBJECT_BYTES)"
            )
