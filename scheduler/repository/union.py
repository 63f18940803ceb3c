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

The view lives in the repository cache (``SLUICE_REPOSITORY_CACHE_DIR``), one folder per set
of repositories; nothing but links, that file and a lock is kept there.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import stat
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path

from sluice.core.repository import DUPLICATE_REASON, DUPLICATES_FILE
from sluice.scheduler.repository.sources import (
    Listing,
    Materialised,
    Model,
    RepositorySource,
    SourceError,
    show,
)

_LOCK = ".lock"
_TMP_PREFIX = ".tmp-"


def view_folder(cache_dir: str, locations: Sequence[str]) -> Path:
    """The view's folder for these repositories, in this order."""
    digest = hashlib.sha256(json.dumps(list(locations)).encode()).hexdigest()[:16]
    return Path(cache_dir) / f"view-{digest}"


class UnionSource(RepositorySource):
    """``sources`` as one repository, materialised as a view in ``view``."""

    def __init__(self, sources: Sequence[RepositorySource], view: Path) -> None:
        self.sources = tuple(sources)
        self.view = view
        self.location = ", ".join(source.location for source in self.sources)
        self._owner: dict[str, int] | None = None
        """Which source holds each model that only one holds, as last listed."""
        self._duplicates: set[str] = set()
        """The names two or more sources hold, as last listed."""

    def list(self) -> Listing:
        return self._joined([source.list() for source in self.sources])

    def served(self) -> Listing:
        return self._joined([source.served() for source in self.sources])

    def materialise(self, listing: Listing) -> Materialised:
        owners = self._owners(listing)
        problems: dict[str, str] = {}
        roots: list[Path] = []
        for index, source in enumerate(self.sources):
            mine = {name: model for name, model in listing.models.items() if owners[name] == index}
            result = source.materialise(Listing(mine))
            problems.update(result.problems)
            roots.append(result.root)
        targets = {
            name: roots[owners[name]] / name
            for name, model in listing.models.items()
            if model.versions or (roots[owners[name]] / name).is_dir()
        }
        _sync_view(self.view, targets, sorted(self._duplicates))
        return Materialised(self.view, problems)

    def _joined(self, listings: Sequence[Listing]) -> Listing:
        """One listing of the repositories' models. A name that two or more of them hold is
        left out (so that what served it is unloaded, as in Triton) and remembered for the
        view."""
        found: dict[str, list[int]] = {}
        for index, part in enumerate(listings):
            for name in (*part.models, *part.refused):
                found.setdefault(name, []).append(index)
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
        self._owner = {name: where[0] for name, where in found.items() if len(where) == 1}
        return Listing(models, refused, tuple(ignored))

    def _owners(self, listing: Listing) -> dict[str, int]:
        """Which source holds each model of ``listing`` (as last listed)."""
        owner = self._owner
        if owner is None or any(name not in owner for name in listing.models):
            self.list()
            owner = self._owner or {}
        missing = [name for name in listing.models if name not in owner]
        if missing:
            raise SourceError(f"model {show(missing[0])} is in none of {self.location}")
        return {name: owner[name] for name in listing.models}


def _sync_view(view: Path, targets: dict[str, Path], duplicates: list[str]) -> None:
    """Make ``view`` hold exactly one link per model of ``targets`` and the list of
    ``duplicates``; each link switches in one rename."""
    try:
        view.mkdir(mode=0o700, parents=True, exist_ok=True)
        if not stat.S_ISDIR(os.lstat(view).st_mode):
            raise SourceError(f"the repository view {view} is not a folder (a link?)")
        with _locked(view):
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
        if name in (_LOCK, DUPLICATES_FILE):
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
    temporary = view / f"{_TMP_PREFIX}{uuid.uuid4().hex}"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(temporary, flags, 0o600)
    with os.fdopen(fd, "w") as out:
        json.dump(duplicates, out)
    os.replace(temporary, view / DUPLICATES_FILE)


@contextlib.contextmanager
def _locked(view: Path) -> Iterator[None]:
    fd = os.open(view / _LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
