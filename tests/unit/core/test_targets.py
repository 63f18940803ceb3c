"""Resolving the model a worker calls (an ensemble's step, a Python model's call), against
a real Redis: what the catalog lists is remembered for a moment, a name it does not list is
not (a model may call names its clients chose: remembering each would grow without
bound)."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from redis.asyncio import Redis as AsyncRedis

from sluice.core.catalog import CatalogEntry, encode_entry
from sluice.core.config.parse import parse_config_text
from sluice.core.errors import NotFound
from sluice.core.keys import Keys
from sluice.core.targets import TargetResolver
from sluice.scheduler.executor.redis_server import RedisServer

CONFIG = """name: "known"
backend: "onnxruntime"
max_batch_size: 8
input [ { name: "X" data_type: TYPE_FP32 dims: [ 2 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ 2 ] } ]
"""


def test_unknown_names_are_not_remembered(redis_server: RedisServer) -> None:
    keys = Keys(f"targets{uuid.uuid4().hex[:8]}")

    async def main() -> None:
        client = AsyncRedis.from_url(redis_server.url)
        try:
            config = parse_config_text(CONFIG, model_name="known")
            entry = encode_entry(CatalogEntry("known", (1,), config))
            await client.hset(keys.catalog, "known", entry)
            await client.incr(keys.catalog_revision)
            resolver = TargetResolver(client, keys)
            for index in range(100):
                with pytest.raises(NotFound):
                    await resolver.resolve(f"chosen-by-a-client-{index}", -1)
                assert not await resolver.ready(f"another-{index}", -1)
            assert not await resolver.ready("known", 1)  # (listed, no live instance)
            assert set(resolver._known) == {"known"}
            assert resolver._known["known"].revision == "1"
        finally:
            await client.aclose()

    asyncio.run(main())
