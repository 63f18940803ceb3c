"""Triton's model namespacing (``--model-namespacing=true``, ``SLUICE_MODEL_NAMESPACING``):
each of several model repositories is a namespace of its own, so that two of them may hold
models of the same name.

Clients still name models by their bare name. A name held by one repository is served
under that name, as without namespacing. A name held by two or more is *ambiguous*: each
copy is served under an internal name, ``<name>@<n>`` for the copy of the n-th repository
(:func:`internal_names`), which only Sluice uses (an ensemble's steps, the executors' loads,
the Redis keys); a request naming the bare name is answered with Triton's error
(:func:`ambiguity`), while the repository index lists each copy under the bare name. An
ensemble's step resolves as Triton resolves it: to the model of that name in the ensemble's
own repository, else to the one model of that name wherever it is; a name several other
repositories hold, and the ensemble's own does not, makes the ensemble unavailable
(:meth:`Namespaces.resolve`).

The view joining the repositories (:mod:`sluice.scheduler.repository.union`) records which
repository each of its models comes from in :data:`NAMESPACES_FILE`, where every reader of
the view (:func:`sluice.core.repository.scan_repository`, ``read_model``) finds it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from sluice.core.errors import InvalidConfig

NAMESPACES_FILE = ".sluice-namespaces.json"
"""In a view joining several repositories with namespacing: which repository each of its
models comes from (:meth:`Namespaces.encode`)."""

_MAX_NAME_BYTES = 255
"""The longest file name a filesystem takes (an internal name names a link of the view)."""


def ambiguity(name: str, count: int) -> str:
    """Triton's answer to a request naming a model that ``count`` repositories hold."""
    return (
        f"There are {count} identifiers of model '{name}' in global map, model namespace "
        "must be provided to resolve ambiguity."
    )


def identifier(namespace: str, name: str) -> str:
    """Triton's identifier of a model in its texts, ``<namespace>::<name>`` (its namespace
    the repository it comes from), or the name alone where there is no namespace."""
    return f"{namespace}::{name}" if namespace else name


def unresolved_steps(repository: str, ensemble: str, names: Iterable[str]) -> str:
    """Triton's reason an ensemble of ``repository`` is unavailable: steps naming models
    that several other repositories hold (``<repository>::<name>``, Triton's identifier)."""
    listed = ", ".join(names)
    return (
        f"ensemble {identifier(repository, ensemble)} contains models that are not available or "
        f"ambiguous: {listed}"
    )


def internal_names(
    holders: Mapping[str, Iterable[int]], taken: Iterable[str]
) -> dict[tuple[str, int], str]:
    """The internal name of each copy of each ambiguous name (``holders``: name -> the
    indexes of the repositories holding it, two or more), ``<name>@<index + 1>``. A name
    among ``taken`` (real models' names) or given already gets another ``@``; one too long
    for a file name is made from its digest. Deterministic: the same holders and names
    always give the same internal names."""
    used = set(taken)
    names: dict[tuple[str, int], str] = {}
    for name in sorted(holders):
        for index in sorted(holders[name]):
            base = name
            if len(f"{name}@{index + 1}@@".encode()) > _MAX_NAME_BYTES:
                base = hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:32]
            candidate = f"{base}@{index + 1}"
            while candidate in used:
                candidate += "@"
            used.add(candidate)
            names[(name, index)] = candidate
    return names


@dataclass(frozen=True)
class Namespaces:
    """Which repository each model of a view comes from."""

    repositories: tuple[str, ...]
    """The repositories, in the order they were named (their locations)."""
    models: Mapping[str, tuple[str, int]]
    """The view's name of each model -> (its bare name, its repository's index)."""
    _holders: dict[str, dict[int, str]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        holders: dict[str, dict[int, str]] = {}
        for view_name, (name, index) in self.models.items():
            holders.setdefault(name, {})[index] = view_name
        object.__setattr__(self, "_holders", holders)

    def name_of(self, view_name: str) -> str:
        """The bare name of the view's model ``view_name`` (itself when not listed)."""
        found = self.models.get(view_name)
        return view_name if found is None else found[0]

    def index_of(self, view_name: str) -> int | None:
        """The index of the repository of the view's model ``view_name``."""
        found = self.models.get(view_name)
        return None if found is None else found[1]

    def repository_of(self, view_name: str) -> str:
        """The repository (its location, as named) the view's model ``view_name`` comes
        from: Triton's namespace of the model; empty when not listed."""
        found = self.models.get(view_name)
        return "" if found is None else self.repositories[found[1]]

    def ambiguous(self) -> dict[str, tuple[str, ...]]:
        """Each name two or more repositories hold -> its copies' internal names, in the
        repositories' order."""
        return {
            name: tuple(where[index] for index in sorted(where))
            for name, where in sorted(self._holders.items())
            if len(where) > 1
        }

    def copies(self, name: str) -> tuple[str, ...]:
        """The internal names of an ambiguous ``name``'s copies (empty for another name)."""
        where = self._holders.get(name, {})
        return tuple(where[index] for index in sorted(where)) if len(where) > 1 else ()

    def is_internal(self, view_name: str) -> bool:
        """Whether ``view_name`` is the internal name of a copy of an ambiguous name."""
        found = self.models.get(view_name)
        return found is not None and found[0] != view_name

    def resolve(self, name: str, index: int) -> str | None:
        """What a step naming ``name`` calls from a model of repository ``index``: ``name``
        itself unless it is ambiguous; then the copy of repository ``index``, or None (no
        copy there: which of the others is meant is ambiguous)."""
        where = self._holders.get(name)
        if where is None or len(where) < 2:
            return name
        return where.get(index)

    def encode(self) -> bytes:
        body = {
            "repositories": list(self.repositories),
            "models": {view: [name, index] for view, (name, index) in sorted(self.models.items())},
        }
        return json.dumps(body, sort_keys=True).encode()

    @classmethod
    def decode(cls, raw: bytes, where: Path) -> Namespaces:
        """:meth:`encode`'s output; InvalidConfig naming ``where`` for anything else."""
        bad = InvalidConfig(f"{where} is not a record of the repositories' models")
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            raise bad from None
        if not isinstance(body, dict):
            raise bad
        repositories, models = body.get("repositories"), body.get("models")
        if not isinstance(repositories, list) or not all(isinstance(r, str) for r in repositories):
            raise bad
        if not isinstance(models, dict):
            raise bad
        read: dict[str, tuple[str, int]] = {}
        for view_name, pair in models.items():
            if not (
                isinstance(pair, list)
                and len(pair) == 2
                and isinstance(pair[0], str)
                and isinstance(pair[1], int)
                and not isinstance(pair[1], bool)
                and 0 <= pair[1] < len(repositories)
            ):
                raise bad
            read[view_name] = (pair[0], pair[1])
        return cls(tuple(repositories), read)


def link_record(repository: Path, staged_root: Path) -> None:
    """Give a folder holding a model staged apart from ``repository`` (a load's overrides)
    the repository's record, if it has one, so that the staged copy is read as the
    repository's model of that name is."""
    record = repository / NAMESPACES_FILE
    link = staged_root / NAMESPACES_FILE
    if record.is_file() and not link.exists():
        link.symlink_to(record.resolve())


def read_namespaces(root: Path) -> Namespaces | None:
    """The record of ``root`` (a view with namespacing), None where there is none (a
    repository served as it is, or a view without namespacing)."""
    path = root / NAMESPACES_FILE
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise InvalidConfig(f"cannot read {path}: {exc.strerror or exc}") from None
    return Namespaces.decode(raw, path)
