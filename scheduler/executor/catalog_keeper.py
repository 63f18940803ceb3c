"""The catalog ``sluice up`` keeps in Redis, published again when Redis lost it."""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from typing import Any, cast

from redis import Redis
from redis.exceptions import RedisError

from sluice.core.keys import Keys
from sluice.core.repository import RepositoryModel
from sluice.scheduler.executor.catalog_publisher import publish_catalog

log = logging.getLogger("sluice.up")


class CatalogKeeper:
    """Republishes the catalog when Redis lost it (a restart without persistence), with
    the load errors workers reported: those workers exited and will not report again."""

    def __init__(
        self,
        client: Redis,
        keys: Keys,
        models: Callable[[], list[RepositoryModel]],
        mode: str,
        on_demand: Callable[[], Collection[str]] = tuple,
    ) -> None:
        self.client, self.keys, self.models, self.mode = client, keys, models, mode
        self.on_demand = on_demand
        self.reachable = True
        self.load_errors: dict[Any, bytes] = {}

    def publish(self) -> None:
        """The catalog of the models served now, and the model control mode in force."""
        self.client.set(self.keys.control_mode, self.mode)
        publish_catalog(self.client, self.keys, self.models(), self.on_demand())

    def tick(self) -> None:
        try:
            if self.client.exists(self.keys.catalog_revision):
                errors = self.client.hgetall(self.keys.load_errors)
                self.load_errors = cast(dict[Any, bytes], errors)
            else:
                log.warning(
                    "the model catalog is gone from Redis (restarted?); publishing it again"
                )
                if self.load_errors:
                    self.client.hset(self.keys.load_errors, mapping=self.load_errors)
                self.publish()
            if not self.reachable:
                log.info("Redis is reachable again")
            self.reachable = True
        except RedisError as exc:
            if self.reachable:
                log.warning("Redis is unreachable: %s", exc)
            self.reachable = False
