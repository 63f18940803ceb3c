"""The local copy of a remote repository, one snapshot folder per model, switched atomically.

Layout of one cache folder (one per repository URL)::

    <cache>/<model>                  symbolic link to .snapshots/<id>, replaced by rename(2)
    <cache>/.snapshots/<random>/     config.pbtxt, <version>/..., .sluice-snapshot.json
    <cache>/.tmp/                    snapshots being written
    <cache>/.lock                    flock(2): one writer at a time

A snapshot is written under ``.tmp``, every file and folder fsynced, renamed into
``.snapshots``, and then the model's link is replaced in one rename: readers
(:func:`sluice.core.repository.scan_repository`, workers) see the model's old content or its
new one, never a half. The unit is the model folder, not the version folder, because
``config.pbtxt`` and label files live beside the versions. Files whose key, size and change
token did not change are hard-linked from the previous snapshot instead of downloaded again.

Nothing is written through a link: files are created with O_EXCL | O_NOFOLLOW inside
folders made here, anything in the cache Sluice did not make is refused by name, and a
file reused from an earlier snapshot must be a regular file reached without a link.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import stat
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

from sluice.scheduler.repository.sources import (
    Entry,
    Listing,
    Materialised,
    Model,
    SourceError,
    Version,
    key_problem,
    show,
)

STATE_NAME = ".sluice-snapshot.json"
_SNAPSHOTS = ".snapshots"
_TMP = ".tmp"
_LOCK = ".lock"
_SNAPSHOT_ID = re.compile(r"[0-9a-f]{32}")
_MAX_STATE_BYTES = 64 << 20


class Sink:
    """Where a fetcher writes one file: refuses bytes beyond the listed size, and checks the
    size and checksum once the fetcher is done. ``reset`` starts over (a retry)."""

    def __init__(self, stream: BinaryIO, entry: Entry, where: str) -> None:
        self.stream, self.entry, self.where = stream, entry, where
        self.received = 0
        self.digest = hashlib.sha256()

    def write(self, data: bytes) -> None:
        if self.received + len(data) > self.entry.size:
            raise SourceError(
                f"{self.where}: the store sends more than the {self.entry.size} bytes it listed"
            )
        self.stream.write(data)
        self.received += len(data)
        self.digest.update(data)

    def reset(self) -> None:
        self.stream.seek(0)
        self.stream.truncate()
        self.received = 0
        self.digest = hashlib.sha256()

    def finish(self) -> None:
        if self.received != self.entry.size:
            raise SourceError(
                f"{self.where}: received {self.received} bytes, the listing said {self.entry.size}"
            )
        if self.entry.sha256 and self.digest.hexdigest() != self.entry.sha256:
            raise SourceError(
                f"{self.where}: the content does not match the manifest's sha256 (changed "
                "after the manifest was written?)"
            )


Fetch = Callable[[str, Entry, Sink], None]
"""Writes the bytes of one file of a model (name, entry) into the sink."""


class SnapshotCache:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.snapshots = root / _SNAPSHOTS
        self.tmp = root / _TMP

    def served(self) -> Listing:
        """The models the cache holds now, as a listing (empty when there is no cache yet)."""
        if not self.root.is_dir():
            return Listing()
        models: dict[str, Model] = {}
        for name, snapshot in sorted(self._links(strict=False).items()):
            model = self._read_state(name, snapshot)
            if model is not None:
                models[name] = model
        return Listing(models)

    def sync(
        self, listing: Listing, fetch: Fetch, where: Callable[[str], str] = str
    ) -> Materialised:
        """Switch every model to its listed content and remove those no longer listed (a
        refused model keeps what it has). A model that fails keeps its old content and is
        reported in ``problems``. ``where`` names a ``model/path`` in messages."""
        self._prepare()
        with self._locked():
            current = self._links(strict=True)
            problems: dict[str, str] = {}
            for name, model in listing.models.items():
                if not model.versions:
                    continue
                try:
                    self._switch(name, model, current.get(name), fetch, where)
                except SourceError as exc:
                    problems[name] = exc.message
            for name in current:
                listed = listing.models.get(name)
                if name not in listing.refused and (listed is None or not listed.versions):
                    os.unlink(self.root / name)
            sync_folder(self.root)
            self._collect_garbage()
        return Materialised(self.root, problems)

    def _prepare(self) -> None:
        try:
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
            for folder in (self.snapshots, self.tmp):
                with contextlib.suppress(FileExistsError):
                    folder.mkdir(mode=0o700)
                if not stat.S_ISDIR(os.lstat(folder).st_mode):
                    raise SourceError(
                        f"the repository cache {folder} is not a folder (a link?); "
                        "remove it or choose another SLUICE_REPOSITORY_CACHE_DIR"
                    )
        except OSError as exc:
            raise SourceError(f"cannot use the repository cache {self.root}: {exc}") from None

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(self.root / _LOCK, flags, 0o600)
        except OSError as exc:
            raise SourceError(f"cannot lock the repository cache {self.root}: {exc}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def _links(self, *, strict: bool) -> dict[str, str]:
        """``{model: snapshot id}`` of the cache's model links. ``strict``: anything else in
        the cache (a folder, a link elsewhere) is an error naming it."""
        links: dict[str, str] = {}
        for name in sorted(os.listdir(self.root)):
            if name in (_SNAPSHOTS, _TMP, _LOCK):
                continue
            path = self.root / name
            target = os.readlink(path) if path.is_symlink() else ""
            folder, _, snapshot = target.partition("/")
            if folder == _SNAPSHOTS and _SNAPSHOT_ID.fullmatch(snapshot):
                links[name] = snapshot
            elif strict:
                raise SourceError(
                    f"the repository cache {self.root} holds {show(name)}, which Sluice did "
                    "not put there; remove it or choose another SLUICE_REPOSITORY_CACHE_DIR"
                )
        return links

    def _switch(
        self,
        name: str,
        model: Model,
        current: str | None,
        fetch: Fetch,
        where: Callable[[str], str],
    ) -> None:
        previous = self._read_state(name, current) if current is not None else None
        if previous is not None and _same(previous, model):
            return
        reusable = _entries(previous) if previous is not None and current is not None else set()
        snapshot = uuid.uuid4().hex
        work = Path(tempfile.mkdtemp(prefix="snapshot-", dir=self.tmp))
        try:
            for entry in sorted(_entries(model), key=lambda e: e.path):
                destination = _make_parents(work, entry.path)
                if not (entry in reusable and self._reuse(current or "", entry, destination)):
                    _download(name, entry, destination, fetch, where)
            _write_new(work / STATE_NAME, json.dumps(_state(name, model)).encode())
            for folder, _, _ in os.walk(work, topdown=False):
                sync_folder(Path(folder))
            os.rename(work, self.snapshots / snapshot)
            sync_folder(self.snapshots)
            link = self.tmp / f"link-{uuid.uuid4().hex}"
            os.symlink(f"{_SNAPSHOTS}/{snapshot}", link)
            os.rename(link, self.root / name)
        except OSError as exc:
            raise SourceError(f"cannot write to the repository cache {self.root}: {exc}") from None
        finally:
            shutil.rmtree(work, ignore_errors=True)

    def _reuse(self, snapshot: str, entry: Entry, destination: Path) -> bool:
        """Hard-link an unchanged file from the previous snapshot; False if it is not there
        as a regular file reached without a link (then it is downloaded again)."""
        source = self.snapshots / snapshot
        try:
            for part in entry.path.split("/")[:-1]:
                source = source / part
                if not stat.S_ISDIR(os.lstat(source).st_mode):
                    return False
            source = source / entry.path.rsplit("/", 1)[-1]
            info = os.lstat(source)
            if not stat.S_ISREG(info.st_mode) or info.st_size != entry.size:
                return False
            os.link(source, destination, follow_symlinks=False)
        except OSError:
            return False
        return True

    def _read_state(self, name: str, snapshot: str) -> Model | None:
        """The model a snapshot holds, from its state file; None when it is unreadable."""
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(self.snapshots / snapshot / STATE_NAME, flags)
            with os.fdopen(fd, "rb") as stream:
                data = stream.read(_MAX_STATE_BYTES + 1)
            if len(data) > _MAX_STATE_BYTES:
                return None
            return _model_from_state(name, json.loads(data))
        except (OSError, ValueError, TypeError, KeyError, AttributeError):
            return None

    def _collect_garbage(self) -> None:
        """Remove snapshots no link points to, and what interrupted writers left in .tmp."""
        referenced = set(self._links(strict=False).values())
        for folder in (self.snapshots, self.tmp):
            for name in os.listdir(folder):
                if folder == self.tmp or name not in referenced:
                    path = folder / name
                    if path.is_dir() and not path.is_symlink():
                        shutil.rmtree(path, ignore_errors=True)
                    else:
                        with contextlib.suppress(OSError):
                            os.unlink(path)


def _state(name: str, model: Model) -> dict[str, Any]:
    def rows(entries: tuple[Entry, ...]) -> list[list[Any]]:
        return [[e.path, e.size, e.token, e.sha256] for e in entries]

    return {
        "model": name,
        "shared": rows(model.shared),
        "versions": {
            str(v): {"token": version.token, "entries": rows(version.entries)}
            for v, version in sorted(model.versions.items())
        },
    }


def _model_from_state(name: str, state: dict[str, Any]) -> Model | None:
    """The inverse of _state, checking what it reads (the cache is on disk: not trusted)."""

    def entries(rows: list[list[Any]]) -> tuple[Entry, ...]:
        result = []
        for path, size, token, sha256 in rows:
            if not isinstance(path, str) or key_problem(path) is not None:
                raise ValueError(path)
            if not (isinstance(size, int) and isinstance(token, str) and isinstance(sha256, str)):
                raise ValueError(path)
            result.append(Entry(path, size, token, sha256))
        return tuple(result)

    if state.get("model") != name:
        return None
    versions = {
        int(v): Version(entries(spec["entries"]), str(spec["token"]))
        for v, spec in state["versions"].items()
    }
    return Model(entries(state["shared"]), dict(sorted(versions.items())))


def _same(a: Model, b: Model) -> bool:
    """Same files and versions (what is not taken is not part of a snapshot)."""
    return (a.shared, dict(a.versions)) == (b.shared, dict(b.versions))


def _entries(model: Model) -> set[Entry]:
    return {*model.shared, *(e for v in model.versions.values() for e in v.entries)}


def _make_parents(work: Path, relative: str) -> Path:
    """The path of ``relative`` under ``work``, its folders made; never outside ``work``."""
    if key_problem(relative) is not None:  # checked when listed; checked again before writing
        raise SourceError(f"refused to write {show(relative)}: {key_problem(relative)}")
    folder = work
    parts = relative.split("/")
    for part in parts[:-1]:
        folder = folder / part
        try:
            folder.mkdir(mode=0o755)
        except FileExistsError:
            if not stat.S_ISDIR(os.lstat(folder).st_mode):
                raise SourceError(f"{show(relative)}: a parent is a file, not a folder") from None
    return folder / parts[-1]


def _write_new(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    with os.fdopen(fd, "wb") as stream:
        stream.write(data)
        stream.flush()
        os.fsync(stream.fileno())


def _download(
    name: str, entry: Entry, destination: Path, fetch: Fetch, where: Callable[[str], str]
) -> None:
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(destination, flags, 0o644)
    with os.fdopen(fd, "w+b") as stream:
        sink = Sink(stream, entry, show(where(f"{name}/{entry.path}")))
        fetch(name, entry, sink)
        sink.finish()
        stream.flush()
        os.fsync(stream.fileno())


def sync_folder(path: Path) -> None:
    """Make a rename or removal in folder ``path`` survive a crash."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
