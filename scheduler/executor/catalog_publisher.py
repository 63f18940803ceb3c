"""Publishing the repository's models into the Redis catalog."""

from __future__ import annotations

from collections.abc import Collection, Sequence

from redis import Redis

from sluice.core.catalog import CatalogEntry, encode_entry
from sluice.core.keys import Keys
from sluice.core.repository import RepositoryModel


def to_entry(model: RepositoryModel, on_demand: bool = False) -> CatalogEntry:
    return CatalogEntry(model.name, model.versions, model.config, model.error, on_demand)


def publish_catalog(
    redis: Redis,
    keys: Keys,
    models: Sequence[RepositoryModel],
    on_demand: Collection[str] = (),
) -> None:
    """Replace the catalog with these models (those named in ``on_demand`` marked so) and
    bump its revision, atomically."""
    with redis.pipeline(transaction=True) as pipe:
        pipe.delete(keys.catalog)
        if models:
            pipe.hset(
                keys.catalog,
                mapping={m.name: encode_entry(to_entry(m, m.name in on_demand)) for m in models},
            )
        pipe.incr(keys.catalog_revision)
        pipe.execute()
