"""The catalog's revision: one more per publication, and never a number given before, even
when Redis lost the revision's key alone (the response cache keys answers with it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from redis import Redis

from sluice.core.keys import Keys
from sluice.core.redis_client.connect import connect
from sluice.core.repository import RepositoryModel
from sluice.scheduler.executor.catalog_publisher import publish_catalog, publish_revision
from sluice.scheduler.executor.redis_server import RedisServer
from tests.support.redis_cluster import LocalRedisCluster


def _revision(redis: Any, keys: Keys) -> int:
    raw = redis.get(keys.catalog_revision)
    assert isinstance(raw, bytes), raw
    return int(raw)


def test_a_lost_revision_starts_past_every_revision_given_before(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    _lose_the_revision(Redis.from_url(redis_server.url), tmp_path)


@pytest.mark.slow  # (a cluster of six servers to start)
def test_the_revision_moves_on_a_cluster_too(
    redis_cluster: LocalRedisCluster, tmp_path: Path
) -> None:
    """A cluster's pipeline takes no ``eval()``: the script goes as a command of its own."""
    _lose_the_revision(connect(redis_cluster.url), tmp_path)


def _lose_the_revision(redis: Any, tmp_path: Path) -> None:
    keys = Keys("revisions")
    models = [RepositoryModel("m", tmp_path / "m", None, (1,))]
    try:
        publish_catalog(redis, keys, models)
        first = _revision(redis, keys)
        publish_catalog(redis, keys, models)
        assert _revision(redis, keys) == first + 1
        assert publish_revision(redis, keys)
        given = _revision(redis, keys)
        assert given == first + 2
        redis.delete(keys.catalog_revision)  # the revision alone is lost; the cache is not
        assert not publish_revision(redis, keys)  # (nothing to number: the keeper publishes)
        publish_catalog(redis, keys, models)
        assert _revision(redis, keys) > given
        redis.set(keys.catalog_revision, 3)  # a deployment of an older version counted from 1
        publish_catalog(redis, keys, models)
        assert _revision(redis, keys) == 4
        redis.delete(keys.catalog_revision)
        publish_catalog(redis, keys, models)
        assert _revision(redis, keys) > given
    finally:
        redis.delete(keys.catalog, keys.catalog_revision)
        redis.close()
