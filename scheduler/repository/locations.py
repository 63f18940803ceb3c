"""The source the ``--model-repository`` values name, and the local directory to serve it from."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from sluice.core.errors import InvalidInput
from sluice.core.settings import RepositorySourceSettings
from sluice.scheduler.repository.local import LocalSource
from sluice.scheduler.repository.sources import RepositorySource, SourceError, carry_over
from sluice.scheduler.repository.union import UnionSource, view_folder

log = logging.getLogger("sluice.sources")


def open_source(
    locations: str | Sequence[str], settings: RepositorySourceSettings
) -> RepositorySource:
    """The source the ``--model-repository`` values name: one repository, or several
    joined in a view (:mod:`.union`; each a namespace with ``SLUICE_MODEL_NAMESPACING``)."""
    if isinstance(locations, str):
        locations = (locations,)
    if len(locations) == 1:
        return _one_source(locations[0], settings)
    if not locations:
        raise SourceError("no model repository is named")
    sources = [_one_source(location, settings) for location in locations]
    view = view_folder(settings.repository_cache_dir, locations)
    return UnionSource(
        sources, view, namespacing=settings.model_namespacing, names=tuple(locations)
    )


def _one_source(location: str, settings: RepositorySourceSettings) -> RepositorySource:
    if location.startswith("s3://"):
        try:
            from sluice.scheduler.repository.s3 import S3Source  # boto3 only where it is needed
        except ImportError as exc:
            if exc.name not in ("boto3", "botocore"):
                raise
            raise SourceError(
                f"model repository {location}: s3:// repositories need boto3, which is not "
                "installed: pip install 'sluice[s3]'"
            ) from None
        try:
            return S3Source(location, settings)
        except InvalidInput as exc:  # (boto3 is imported when the client is made)
            raise SourceError(f"model repository {location}: {exc.message}") from None
    if "://" in location:
        scheme = location.split("://", 1)[0]
        raise SourceError(
            f"model repository {location}: unsupported scheme '{scheme}://' "
            "(a local directory or s3://bucket/prefix)"
        )
    return LocalSource(Path(location).resolve())


def snapshot_repository(locations: str | Sequence[str], settings: RepositorySourceSettings) -> Path:
    """The local directory to serve ``locations`` from: the directory itself, a cache
    holding the complete versions of a remote repository, or a view joining several, taken
    now. What is not taken is logged (each model refused, each version incomplete), and
    serving goes on without it."""
    source = open_source(locations, settings)
    if isinstance(source, LocalSource):
        return source.root
    served = source.served()
    listing = carry_over(served, source.list())
    for line in listing.problems():
        log.warning("%s: %s", source.location, line)
    result = source.materialise(listing)
    for name, reason in result.problems.items():
        log.warning("%s: model '%s' not taken: %s", source.location, name, reason)
    versions = sum(len(m.versions) for m in listing.models.values())
    log.info(
        "model repository %s: %d version(s) of %d model(s) in %s",
        source.location,
        versions,
        sum(1 for m in listing.models.values() if m.versions),
        result.root,
    )
    return result.root
