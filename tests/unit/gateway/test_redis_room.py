"""The gateway's view of the room left in Redis (:mod:`sluice.gateway.redis_room`): on a real
redis-server with a small ``maxmemory``, new work is refused above the high-water mark and
accepted again once Redis has drained."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Iterator

import pytest
from redis.asyncio import Redis

from sluice.core.errors import Overloaded
from sluice.gateway.redis_room import RETRY_AFTER_S, RedisRoom
from sluice.scheduler.executor.redis_server import RedisServer

MAXMEMORY = 16 << 20


@pytest.fixture
def small_redis() -> Iterator[RedisServer]:
    """A redis-server of this test's own: its maxmemory is changed."""
    server = RedisServer()
    server.start()
    yield server
    server.stop()


@pytest.fixture
async def redis(small_redis: RedisServer) -> AsyncIterator[Redis]:
    client = Redis.from_url(small_redis.url)
    yield client
    await client.aclose()


async def _fill(redis: Redis, share: float) -> None:
    """Write values until Redis uses at least ``share`` of its maxmemory (in small pieces:
    a large command's own buffer would pass maxmemory first)."""
    while int((await redis.info("memory"))["used_memory"]) < MAXMEMORY * share:
        await redis.rpush("ballast", b"\0" * (64 << 10))


async def test_new_work_is_refused_above_the_high_water_mark_and_accepted_again(
    redis: Redis,
) -> None:
    await redis.config_set("maxmemory", MAXMEMORY)
    await redis.config_set("maxmemory-policy", "noeviction")
    room = RedisRoom(0.85)
    await room.refresh(redis)
    assert not room.full and room.max_bytes == MAXMEMORY
    room.check()
    await _fill(redis, 0.92)
    await room.refresh(redis)
    assert room.full
    with pytest.raises(Overloaded) as refused:
        room.check()
    assert refused.value.retry_after_s == RETRY_AFTER_S
    assert refused.value.status == 503
    assert re.fullmatch(
        r"Redis is 9\d% full \(its maxmemory\); retry later", refused.value.message
    ), refused.value.message
    await redis.delete("ballast")
    await room.refresh(redis)
    assert not room.full
    room.check()


async def test_without_maxmemory_nothing_is_refused(redis: Redis) -> None:
    await redis.config_set("maxmemory", 0)
    await redis.set("ballast", b"\0" * (1 << 20))
    room = RedisRoom(0.01)
    await room.refresh(redis)
    assert not room.full and room.max_bytes == 0
    room.check()


def test_the_fullest_primary_decides_and_zero_turns_the_check_off() -> None:
    nodes = [
        {"used_memory": 10, "maxmemory": 100},
        {"used_memory": 95, "maxmemory": 100},
        {"used_memory": 999, "maxmemory": 0},
    ]
    room = RedisRoom(0.9)
    room.observe(nodes)
    assert room.full and room.used_bytes == 95
    off = RedisRoom(0.0)
    off.observe(nodes)
    assert not off.full
    off.check()
    room.observe([{"used_memory": "garbage"}])
    assert not room.full
