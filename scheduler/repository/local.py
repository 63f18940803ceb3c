"""A model repository in a local directory, served in place."""

from __future__ import annotations

import os
from pathlib import Path

from sluice.scheduler.repository.sources import (
    MAX_DEPTH,
    VERSION_DIR,
    Entry,
    Listing,
    Materialised,
    Model,
    RepositorySource,
    SourceError,
    Version,
    version_token,
)


class LocalSource(RepositorySource):
    """A directory, served in place: everything present is complete, as for Triton (copy a
    version elsewhere on the same filesystem and rename it into place to change it)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.location = str(root)

    def list(self) -> Listing:
        try:
            names = sorted(os.listdir(self.root))
        except OSError as exc:
            raise SourceError(f"cannot list the model repository {self.root}: {exc}") from None
        models: dict[str, Model] = {}
        for name in names:
            path = self.root / name
            if name.startswith(".") or not path.is_dir():
                continue
            shared: list[Entry] = []
            files: dict[int, list[Entry]] = {}
            for entry in _walk(path):
                first, slash, _ = entry.path.partition("/")
                if slash and VERSION_DIR.fullmatch(first):
                    files.setdefault(int(first), []).append(entry)
                elif not (slash and first.isdigit()):
                    shared.append(entry)
            for folder in path.iterdir():
                if VERSION_DIR.fullmatch(folder.name) and folder.is_dir():
                    files.setdefault(int(folder.name), [])  # an empty version is one too
            versions = {
                v: Version(tuple(fs), version_token(shared, fs)) for v, fs in sorted(files.items())
            }
            models[name] = Model(tuple(shared), versions)
        return Listing(models)

    def served(self) -> Listing:
        return self.list()

    def materialise(self, listing: Listing) -> Materialised:
        return Materialised(self.root)


def _walk(model_dir: Path) -> list[Entry]:
    """Every file under a local model folder, sorted; symbolic links are followed as
    Triton does, to a bounded depth so that a loop ends."""
    entries: list[Entry] = []
    for folder, dirs, names in os.walk(model_dir, followlinks=True):
        relative = Path(folder).relative_to(model_dir)
        if len(relative.parts) >= MAX_DEPTH:
            dirs.clear()
        for file_name in names:
            try:
                stat = (Path(folder) / file_name).stat()
            except OSError:
                continue  # removed meanwhile, or a dangling link
            path = (relative / file_name).as_posix()
            entries.append(Entry(path, stat.st_size, f"{stat.st_mtime_ns}:{stat.st_size}"))
    return sorted(entries, key=lambda e: e.path)
