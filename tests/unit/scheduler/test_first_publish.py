"""An executor's first publish clears the load errors a previous run left, but not those
of the live executors it joins (a failed load they list, an on-demand version their budget
refused): their gateways would answer those models as never failed."""

from __future__ import annotations

import uuid

from redis import Redis

from sluice.core.control import REGISTER_EXECUTOR
from sluice.core.keys import Keys
from sluice.scheduler.executor.catalog_keeper import CatalogKeeper
from sluice.scheduler.executor.redis_server import RedisServer
from sluice.scheduler.executor.up import _first_publish


def _publish(client: Redis, keys: Keys) -> None:
    _first_publish(client, keys, CatalogKeeper(client, keys, list, "explicit"), "redis://")


def test_a_start_alone_clears_the_load_errors_of_a_previous_run(redis_server: RedisServer) -> None:
    keys = Keys(f"first-{uuid.uuid4().hex[:8]}")
    with Redis.from_url(redis_server.url) as client:
        client.hset(keys.load_errors, "m/1", "it failed")
        _publish(client, keys)
        assert not client.exists(keys.load_errors)


def test_an_executor_that_joins_live_ones_keeps_their_load_errors(
    redis_server: RedisServer,
) -> None:
    keys = Keys(f"first-{uuid.uuid4().hex[:8]}")
    with Redis.from_url(redis_server.url) as client:
        client.eval(REGISTER_EXECUTOR, 1, keys.executors, "other", 30)
        client.hset(keys.load_errors, "m/1", "it failed")
        _publish(client, keys)
        assert client.hgetall(keys.load_errors) == {b"m/1": b"it failed"}
