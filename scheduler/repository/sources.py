"""Where a model repository comes from: a local directory, served in place, or a remote
store (``s3://bucket/prefix``) whose complete model versions are copied into a local cache.

A source lists what it holds (:class:`Listing`: models, their versions, a change token per
version) and materialises a listing as a Triton-layout directory that
:func:`sluice.core.repository.scan_repository` and the workers read. The caller polls: it lists
again, and :func:`diff` says which versions appeared, changed or disappeared.

This module is the lower layer every source shares: the listing types, the source's
interface, and the checks of keys. :mod:`.local` serves a directory in place; remote stores
(:mod:`.s3`) decide which versions are complete with :mod:`.listing` (a manifest written
last) and copy them through :mod:`.cache` (an atomic switch per model); :mod:`.locations`
picks the source a ``--model-repository`` names. Everything a store sends is
hostile until checked; :func:`key_problem` says why a key cannot become a local path.
"""

from __future__ import annotations

import hashlib
import json
import re
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

_MAX_KEY_BYTES = 1024
_MAX_NAME_BYTES = 255
MAX_DEPTH = 16
# As sluice.core.repository: Triton ignores version folders such as "0", "01" or "v1".
VERSION_DIR = re.compile(r"[1-9][0-9]*")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


class SourceError(Exception):
    """A repository, model or object that cannot be taken; the message says which and why."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


@dataclass(frozen=True, slots=True)
class Entry:
    """One file of a model."""

    path: str
    """Relative to the model folder, with ``/``: ``config.pbtxt``, ``1/model.onnx``."""
    size: int
    token: str
    """Changes whenever the content may have: the ETag (S3), ``mtime_ns:size`` locally."""
    sha256: str = ""
    """From the version's manifest, checked after a download; empty when none."""


@dataclass(frozen=True, slots=True)
class Version:
    entries: tuple[Entry, ...]
    """The files of the version folder."""
    token: str
    """Changes when a file of the version, or a file beside the versions, changes."""


@dataclass(frozen=True, slots=True)
class Model:
    shared: tuple[Entry, ...] = ()
    """Files beside the versions: ``config.pbtxt``, label files, ``warmup/``."""
    versions: Mapping[int, Version] = field(default_factory=dict)
    """Complete versions."""
    not_taken: Mapping[int, str] = field(default_factory=dict)
    """Versions present but not taken (incomplete upload, over a limit), with the reason."""


@dataclass(frozen=True, slots=True)
class Listing:
    models: Mapping[str, Model] = field(default_factory=dict)
    refused: Mapping[str, str] = field(default_factory=dict)
    """Models refused as a whole (a hostile key among their objects), with the reason."""
    ignored: tuple[str, ...] = ()
    """Keys refused outside any model, one message each."""

    def problems(self) -> list[str]:
        """One line per thing not taken, for the log."""
        lines = [f"model '{name}' refused: {reason}" for name, reason in self.refused.items()]
        for name, model in self.models.items():
            lines += [
                f"model '{name}' version {v} not taken: {why}" for v, why in model.not_taken.items()
            ]
        return lines + list(self.ignored)


@dataclass(frozen=True, slots=True)
class Changes:
    appeared: tuple[tuple[str, int], ...] = ()
    changed: tuple[tuple[str, int], ...] = ()
    disappeared: tuple[tuple[str, int], ...] = ()

    def __bool__(self) -> bool:
        return bool(self.appeared or self.changed or self.disappeared)


@dataclass(frozen=True, slots=True)
class Materialised:
    root: Path
    """A Triton-layout repository: what scan_repository and the workers read."""
    problems: Mapping[str, str] = field(default_factory=dict)
    """Models that could not be switched to the listing (they keep what they had)."""


class RepositorySource(ABC):
    location: str

    @abstractmethod
    def list(self) -> Listing:
        """What the source holds now."""

    @abstractmethod
    def served(self) -> Listing:
        """What the materialised directory holds now (the copy taken earlier, if any)."""

    @abstractmethod
    def materialise(self, listing: Listing) -> Materialised:
        """Make the listing's versions readable under the returned root; each model
        switches as a whole from its old content to its new, never to a half."""


def diff(old: Listing, new: Listing) -> Changes:
    """Which complete versions appeared, changed or disappeared from ``old`` to ``new``
    (both as :func:`carry_over` returns them)."""
    appeared: list[tuple[str, int]] = []
    changed: list[tuple[str, int]] = []
    disappeared: list[tuple[str, int]] = []
    for name in sorted(set(old.models) | set(new.models)):
        before = old.models[name].versions if name in old.models else {}
        after = new.models[name].versions if name in new.models else {}
        for version in sorted(set(before) | set(after)):
            if version not in before:
                appeared.append((name, version))
            elif version not in after:
                disappeared.append((name, version))
            elif before[version].token != after[version].token:
                changed.append((name, version))
    return Changes(tuple(appeared), tuple(changed), tuple(disappeared))


def carry_over(served: Listing, listed: Listing) -> Listing:
    """``listed``, keeping what is served where the store's side is not taken: a refused
    model keeps its served versions, and so does a version not taken (being uploaded again).
    Nothing served is dropped or replaced for a half-written upload."""
    models = dict(listed.models)
    for name, old in served.models.items():
        new = listed.models.get(name)
        if name in listed.refused:
            models[name] = old
        elif new is not None:
            held = {v: old.versions[v] for v in new.not_taken if v in old.versions}
            if held:
                versions = dict(sorted({**new.versions, **held}.items()))
                models[name] = replace(new, versions=versions)
    return replace(listed, models=models)


def poll(source: RepositorySource, served: Listing) -> tuple[Listing, Changes]:
    """List ``source`` again: the listing to materialise next, and what changed since
    ``served``. The caller materialises it, then passes it as ``served`` next time."""
    listed = carry_over(served, source.list())
    return listed, diff(served, listed)


def show(key: str) -> str:
    """A key as it may appear in a message: quoted, with anything unprintable escaped."""
    return ascii(key)


def key_problem(path: str) -> str | None:
    """Why a relative key (``model/1/model.onnx``) cannot become a local path; None if it can."""
    if not path:
        return "the key is empty"
    if "\x00" in path:
        return "it contains a NUL character"
    if _CONTROL.search(path):
        return "it contains a control character"
    if "\\" in path:
        return "it contains a backslash"
    if path.startswith("/"):
        return "it is an absolute path"
    try:
        encoded = path.encode("utf-8")
    except UnicodeEncodeError:
        return "it is not valid UTF-8"
    if len(encoded) > _MAX_KEY_BYTES:
        return f"it is longer than {_MAX_KEY_BYTES} bytes"
    parts = path.split("/")
    if "" in parts:
        return "it has an empty path component ('//' or a trailing '/')"
    if any(part in (".", "..") for part in parts):
        return "it has a '.' or '..' path component"
    if len(parts) > MAX_DEPTH:
        return f"it is nested deeper than {MAX_DEPTH} folders"
    if any(len(part.encode("utf-8")) > _MAX_NAME_BYTES for part in parts):
        return f"a path component is longer than {_MAX_NAME_BYTES} bytes"
    return None


def path_conflict(paths: Iterable[str]) -> str | None:
    """A path that is both a file and a folder (``a`` and ``a/b``), or None."""
    files = set(paths)
    for path in files:
        parts = path.split("/")
        for depth in range(1, len(parts)):
            if "/".join(parts[:depth]) in files:
                return "/".join(parts[:depth])
    return None


def version_token(*groups: Iterable[Entry]) -> str:
    digest = hashlib.sha256()
    for group in groups:
        for entry in group:
            digest.update(json.dumps([entry.path, entry.size, entry.token, entry.sha256]).encode())
        digest.update(b"|")
    return digest.hexdigest()
