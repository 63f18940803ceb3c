"""Publishing the repository's models into the Redis catalog, and its revision.

The revision moves with every publication, atomically with the catalog it numbers; gateways
reload the catalog when it moves, and the response cache keys every answer with it
(:mod:`sluice.core.response_cache`), so an answer kept before a change of what a model
serves is never served after it. :func:`publish_revision` moves it for a change the catalog
does not show (new weights behind the same entry).

A revision is never given twice, even when its key alone is lost: a missing key starts again
from Redis's clock in microseconds, past every number counted before (a counter started
again at 1 would name a revision under which answers of older weights may still be cached)."""

from __future__ import annotations

from collections.abc import Collection, Sequence

from redis import Redis

from sluice.core.catalog import CatalogEntry, encode_entry
from sluice.core.keys import Keys
from sluice.core.repository import RepositoryModel


def to_entry(model: RepositoryModel, on_demand: bool = False) -> CatalogEntry:
    return CatalogEntry(
        model.name,
        model.versions,
        model.config,
        model.error,
        on_demand,
        listed_as=model.listed_as,
        ambiguous=model.ambiguous,
        namespace=model.namespace,
        once_loaded=model.once_loaded,
    )


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
        # (as a plain command: a cluster's pipeline has no eval() of its own)
        pipe.execute_command(  # type: ignore[no-untyped-call]
            "EVAL", _NEXT_REVISION, 1, keys.catalog_revision
        )
        pipe.execute()


_NEXT_REVISION = """
if redis.call('EXISTS', KEYS[1]) == 1 then
    return redis.call('INCR', KEYS[1])
end
local now = redis.call('TIME')
local start = tonumber(now[1]) * 1000000 + tonumber(now[2])
redis.call('SET', KEYS[1], string.format('%.0f', start))
return start
"""


_NEW_REVISION = """
if redis.call('EXISTS', KEYS[1]) == 1 then
    return redis.call('INCR', KEYS[1])
end
return false
"""


def publish_revision(redis: Redis, keys: Keys) -> bool:
    """A new revision of the catalog as it stands: the weights behind an entry changed (a
    Kubernetes rollout), which the entry does not show. Whether there was a catalog to
    number: without one nothing is written, so that the catalog's keepers still find it lost
    and publish it again (with a new revision of its own)."""
    return redis.eval(_NEW_REVISION, 1, keys.catalog_revision) is not None
