"""Several model repositories served as one, as Triton serves ``--model-repository`` given
more than once.

Model names are global across the repositories: a model found in two or more of them is
served from none and shows as unavailable ("model appears in two or more repositories", as
in Triton), while the others are served from wherever they are, and an ensemble may compose
models of another repository.

The repositories are joined in a *view*: a folder of symbolic links, one per model, to the
model's folder in its own repository (a local directory, or the local copy of a remote one).
Everything that reads a repository (:func:`sluice.core.repository.scan_repository`, the
workers, the executors' loads) reads the view as one repository. Each link is replaced with
one rename, so a reader sees a model's old place or its new one; a duplicated name is listed
in the view's :data:`~sluice.core.repository.DUPLICATES_FILE`, where the scan finds it.

With model namespacing (Triton's ``--model-namespacing=true``, ``SLUICE_MODEL_NAMESPACING``)
each repository is a namespace (:mod:`sluice.core.repository_namespaces`): a name two or more
of them hold is served from each, every copy linked under its internal name, and the view's
:data:`~sluice.core.repository_namespaces.NAMESPACES_FILE` records which repository each
link comes from. While names are held twice, each version's change token carries which of
them its repository holds: when that changes, an ensemble's steps may resolve to other
models, so poll mode loads the models again.

The view lives in the repository cache (``SLUICE_REPOSITORY_CACHE_DIR``), one folder per set
of repositories; nothing but links, those files and a lock is kept there.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import stat
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path

from sluice.core.repository import DUPLICATE_REASON, DUPLICATES_FILE
from sluice.core.repository_namespaces import NAMESPACES_FILE, Namespaces, internal_names
from sluice.scheduler.repository.sources import (
    Listing,
    Materialised,
    Model,
    RepositorySource,
    SourceError,
    Version,
    show,
)

_LOCK = ".lock"
_TMP_PREFIX = ".tmp-"
_CONTEXT = "|namespaces:"
"""Joins a version's change token and what its repository holds of the ambiguous names."""


def view_folder(cache_dir: str, locations: Sequence[str]) -> Path:
    """The view's folder for these repositories, in this order."""
    digest = hashlib.sha256(json.dumps(list(locations)).encode()).hexdigest()[:16]
    return Path(cache_dir) / f"view-{digest}"


class UnionSource(RepositorySource):
    """``sources`` as one repository, materialised as a view in ``view``; with
    ``namespacing``, each source a namespace of its own."""

    def __init__(
        self,
        sources: Sequence[RepositorySource],
        view: Path,
        *,
        namespacing: bool = False,
        names: Sequence[str] = (),
    ) -> None:
        self.sources = tuple(sources)
        self.view = view
        self.namespacing = namespacing
        self.names = tuple(names) or tuple(source.location for source in self.sources)
        """Each source's namespace with namespacing: its location as the user named it
        (Triton's namespace is the repository path as given)."""
        self.location = ", ".join(source.location for source in self.sources)
        self._owner: dict[str, tuple[int, str]] | None = None
        """The view's name of each model served -> (the source holding it, its name
        there), as last listed."""
        self._duplicates: set[str] = set()
        """The names two or more sources hold, served from none, as last listed (never
        with namespacing)."""
        self._namespaces: Namespaces | None = None
        """With namespacing: the record of the view, as last listed."""

    def list(self) -> Listing:
        return self._joined([source.list() for source in self.sources])

    def served(self) -> Listing:
        return self._joined([source.served() for source in self.sources])

    def materialise(self, listing: Listing) -> Materialised:
        owners = self._owners(listing)
        problems: dict[str, str] = {}
        roots: list[Path] = []
        for index, source in enumerate(self.sources):
            names = {owners[name][1]: name for name in listing.models if owners[name][0] == index}
            mine = {own: _without_context(listing.models[name]) for own, name in names.items()}
            result = source.materialise(Listing(mine))
            problems.update((names.get(own, own), why) for own, why in result.problems.items())
            roots.append(result.root)
        targets = {}
        for name, model in listing.models.items():
            index, own = owners[name]
            if model.versions or (roots[index] / own).is_dir():
                targets[name] = roots[index] / own
        namespaces = self._namespaces if self.namespacing else None
        _sync_view(self.view, targets, sorted(self._duplicates), namespaces)
        return Materialised(self.view, problems)

    def _joined(self, listings: Sequence[Listing]) -> Listing:
        """One listing of the repositories' models. A name that two or more of them hold is
        left out (so that what served it is unloaded, as in Triton) and remembered for the
        view; with namespacing, each copy is listed under its internal name instead."""
        found: dict[str, list[int]] = {}
        for index, part in enumerate(listings):
            for name in (*part.models, *part.refused):
                found.setdefault(name, []).append(index)
        if self.namespacing:
            return self._namespaced(listings, found)
        models: dict[str, Model] = {}
        refused: dict[str, str] = {}
        ignored: list[str] = []
        for index, part in enumerate(listings):
            source = self.sources[index].location
            ignored += [f"{source}: {line}" for line in part.ignored]
            for name, model in part.models.items():
                if len(found[name]) == 1:
                    models[name] = model
            for name, reason in part.refused.items():
                if len(found[name]) == 1:
                    refused[name] = reason
        duplicates = {name: where for name, where in found.items() if len(where) > 1}
        for name, where in sorted(duplicates.items()):
            places = ", ".join(self.sources[index].location for index in where)
            ignored.append(f"model {show(name)} not served: {DUPLICATE_REASON} ({places})")
        self._duplicates = set(duplicates)
        self._owner = {name: (where[0], name) for name, where in found.items() if len(where) == 1}
        return Listing(models, refused, tuple(ignored))

    def _namespaced(
        self, listings: Sequence[Listing], found: Mapping[str, Sequence[int]]
    ) -> Listing:
        """One listing of the repositories' models, each source a namespace: every model
        listed, the copies of a name several sources hold under their internal names, and
        every version's token carrying what its source holds of those names."""
        ambiguous = {name: where for name, where in found.items() if len(where) > 1}
        internal = internal_names(ambiguous, found)
        models: dict[str, Model] = {}
        refused: dict[str, str] = {}
        ignored: list[str] = []
        owner: dict[str, tuple[int, str]] = {}
        for index, part in enumerate(listings):
            ignored += [f"{self.sources[index].location}: {line}" for line in part.ignored]
            context = _context(ambiguous, index)
            for name, model in part.models.items():
                view_name = internal.get((name, index), name)
                models[view_name] = _with_context(model, context)
                owner[view_name] = (index, name)
            for name, reason in part.refused.items():
                view_name = internal.get((name, index), name)
                refused[view_name] = reason
                owner[view_name] = (index, name)
        self._duplicates = set()
        self._owner = owner
        self._namespaces = Namespaces(
            self.names,
            {view_name: (name, index) for view_name, (index, name) in owner.items()},
        )
        return Listing(models, refused, tuple(ignored))

    def _owners(self, listing: Listing) -> dict[str, tuple[int, str]]:
        """Which source holds each model of ``listing``, and under which name (as last
        listed)."""
        owner = self._owner
        if owner is None or any(name not in owner for name in listing.models):
            self.list()
            owner = self._owner or {}
        missing = [name for name in listing.models if name not in owner]
        if missing:
            raise SourceError(f"model {show(missing[0])} is in none of {self.location}")
        return {name: owner[name] for name in listing.models}


def _context(ambiguous: Mapping[str, Sequence[int]], index: int) -> str:
    """What source ``index`` holds of the ``ambiguous`` names (their holders), as a digest;
    empty when no name is ambiguous."""
    if not ambiguous:
        return ""
    held = [[name, index in where] for name, where in sorted(ambiguous.items())]
    return hashlib.sha256(json.dumps(held).encode()).hexdigest()[:16]


def _with_context(model: Model, context: str) -> Model:
    """``model``, each version's token joined with ``context`` (none: as it is)."""
    if not context:
        return model
    versions = {
        number: Version(version.entries, f"{version.token}{_CONTEXT}{context}")
        for number, version in model.versions.items()
    }
    return replace(model, versions=versions)


def _without_context(model: Model) -> Model:
    """``model`` as its source listed it (:func:`_with_context` undone)."""
    if not any(_CONTEXT in version.token for version in model.versions.values()):
        return model
    versions = {
        number: Version(version.entries, version.token.rpartition(_CONTEXT)[0])
        if _CONTEXT in version.token
        else version
        for number, version in model.versions.items()
    }
    return replace(model, versions=versions)


def _sync_view(
    view: Path,
    targets: dict[str, Path],
    duplicates: list[str],
    namespaces: Namespaces | None = None,
) -> None:
    """Make ``view`` hold exactly one link per model of ``targets``, the list of
    ``duplicates`` and the record of ``namespaces`` (none: no record); each link switches in
    one rename. The record is written before the links: a reader that finds a new link
    finds what it is."""
    try:
        view.mkdir(mode=0o700, parents=True, exist_ok=True)
        if not stat.S_ISDIR(os.lstat(view).st_mode):
            raise SourceError(f"the repository view {view} is not a folder (a link?)")
        with _locked(view):
            if namespaces is not None:
                _write_file(view, NAMESPACES_FILE, namespaces.encode())
            else:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(view / NAMESPACES_FILE)
            present = _links(view)
            for name, target in targets.items():
                if present.get(name) != str(target):
                    temporary = view / f"{_TMP_PREFIX}{uuid.uuid4().hex}"
                    os.symlink(target, temporary)
                    os.replace(temporary, view / name)
            for name in set(present) - set(targets):
                os.unlink(view / name)
            _write_duplicates(view, duplicates)
    except OSError as exc:
        raise SourceError(f"cannot use the repository view {view}: {exc}") from None


def _links(view: Path) -> dict[str, str]:
    """``{model: target}`` of the view's links; anything else the view holds that Sluice did
    not put there is an error naming it."""
    links: dict[str, str] = {}
    for name in os.listdir(view):
        path = view / name
        if name in (_LOCK, DUPLICATES_FILE, NAMESPACES_FILE):
            continue
        if name.startswith(_TMP_PREFIX) and (path.is_symlink() or path.is_file()):
            os.unlink(path)  # left by a writer that stopped half-way
            continue
        if not path.is_symlink():
            raise SourceError(
                f"the repository view {view} holds {show(name)}, which Sluice did not put "
                "there; remove it or choose another SLUICE_REPOSITORY_CACHE_DIR"
            )
        links[name] = os.readlink(path)
    return links


def _write_duplicates(view: Path, duplicates: list[str]) -> None:
    _write_file(view, DUPLICATES_FILE, json.dumps(duplicates).encode())


def _write_file(view: Path, name: str, content: bytes) -> None:
    """``view / name`` replaced by ``content`` in one rename."""
    temporary = view / f"{_TMP_PREFIX}{uuid.uuid4().hex}"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(temporary, flags, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(content)
    os.replace(temporary, view / name)


@contextlib.contextmanager
def _locked(view: Path) -> Iterator[None]:
    fd = os.open(view / _LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
