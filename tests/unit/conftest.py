"""Fixtures the unit tests share (the tests' own redis-server is started in tests/conftest.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis

from sluice.scheduler.executor.redis_server import RedisServer


@pytest.fixture
async def redis(redis_server: RedisServer) -> AsyncIterator[Redis]:
    """An asyncio client of the tests' redis-server (not emptied: each test uses a namespace
    of its own), closed after the test."""
    client = Redis.from_url(redis_server.url)
    yield client
    await client.aclose()
