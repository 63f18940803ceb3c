"""The response cache's scripts on a real Redis (:mod:`sluice.core.response_cache`): a
kept answer comes back whole, the least recently used go first when room is needed, an
answer larger than the cache is not kept, answers unused past their time expire, keeping
the same key again replaces it, and the key tells tenants, inputs and outputs apart."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from typing import Any, cast

import pytest
from redis import Redis
from redis.asyncio import Redis as AsyncRedis

from sluice.core.keys import Keys
from sluice.core.response_cache import ResponseCache, digest, pack_answer
from sluice.core.settings import GatewaySettings
from sluice.core.wire import ReplyMessage, TensorHeader
from sluice.scheduler.executor.redis_server import RedisServer


def _answer(size: int, fill: bytes = b"x") -> tuple[ReplyMessage, bytes]:
    payload = fill * size
    reply = ReplyMessage("k", 1, [TensorHeader("OUT", "UINT8", (1, size), size)])
    return reply, payload


@pytest.fixture
def keys() -> Keys:
    return Keys(f"cache{uuid.uuid4().hex[:8]}")


@pytest.fixture
def sync_redis(redis_server: RedisServer) -> Iterator[Redis]:
    client = Redis.from_url(redis_server.url)
    yield client
    client.close()


def _run(redis_server: RedisServer, keys: Keys, limit: int, ttl_s: float, steps: Any) -> Any:
    async def main() -> Any:
        client = AsyncRedis.from_url(redis_server.url)
        try:
            return await steps(ResponseCache(client, keys, limit, ttl_s))
        finally:
            await client.aclose()

    return asyncio.run(main())


def _total(sync_redis: Redis, keys: Keys) -> int:
    return int(cast(bytes, sync_redis.get(f"{keys.cache_index()}:total") or b"0"))


def test_a_kept_answer_comes_back_whole(redis_server: RedisServer, keys: Keys) -> None:
    reply, payload = _answer(100, b"\x07")

    async def steps(cache: ResponseCache) -> Any:
        assert await cache.get("a") is None
        assert await cache.put("a", pack_answer(reply, payload))
        return await cache.get("a")

    found = _run(redis_server, keys, 10_000, 60, steps)
    assert found is not None
    message, data = found
    assert (message.model_version, message.outputs) == (1, reply.outputs)
    assert bytes(data) == payload


def test_the_least_recently_used_go_first(
    redis_server: RedisServer, keys: Keys, sync_redis: Redis
) -> None:
    values = {name: pack_answer(*_answer(1000)) for name in "abcd"}
    size = len(values["a"])

    async def steps(cache: ResponseCache) -> Any:
        for name in "abc":
            assert await cache.put(name, values[name])
        assert await cache.get("a") is not None  # a is now more recent than b
        assert await cache.put("d", values["d"])  # room for three: b goes
        return {name: await cache.get(name) is not None for name in "abcd"}

    kept = _run(redis_server, keys, 3 * size + 10, 60, steps)
    assert kept == {"a": True, "b": False, "c": True, "d": True}
    assert _total(sync_redis, keys) == 3 * size
    assert sync_redis.zcard(keys.cache_index()) == 3


def test_an_answer_larger_than_the_cache_is_not_kept(
    redis_server: RedisServer, keys: Keys, sync_redis: Redis
) -> None:
    big = pack_answer(*_answer(5000))

    async def steps(cache: ResponseCache) -> Any:
        return await cache.put("big", big), await cache.get("big")

    assert _run(redis_server, keys, 4000, 60, steps) == (False, None)
    assert _total(sync_redis, keys) == 0


def test_unused_answers_expire_and_their_room_comes_back(
    redis_server: RedisServer, keys: Keys, sync_redis: Redis
) -> None:
    value = pack_answer(*_answer(1000))

    async def steps(cache: ResponseCache) -> Any:
        assert await cache.put("old", value)
        await asyncio.sleep(0.35)  # past its time to live
        assert await cache.get("old") is None
        assert await cache.put("new", value)  # forgets what expired first
        return await cache.get("new") is not None

    assert _run(redis_server, keys, 10_000, 0.3, steps) is True
    assert _total(sync_redis, keys) == len(value)
    assert sync_redis.zrange(keys.cache_index(), 0, -1) == [b"new"]


def test_keeping_a_key_again_replaces_it(
    redis_server: RedisServer, keys: Keys, sync_redis: Redis
) -> None:
    first, second = pack_answer(*_answer(100)), pack_answer(*_answer(300, b"y"))

    async def steps(cache: ResponseCache) -> Any:
        await cache.put("same", first)
        await cache.put("same", second)
        found = await cache.get("same")
        return bytes(found[1]) if found else None

    assert _run(redis_server, keys, 10_000, 60, steps) == b"y" * 300
    assert _total(sync_redis, keys) == len(second)


def test_the_key_tells_requests_apart() -> None:
    def key(**changes: Any) -> str:
        request: dict[str, Any] = {
            "tenant": "team-a",
            "model": "m",
            "version": 1,
            "inputs": [TensorHeader("IN", "FP32", (1, 2), 8)],
            "payload": b"\x00" * 8,
            "outputs": ["OUT"],
            "classes": {},
            "parameters": {},
        }
        request.update(changes)
        return digest(**request)

    changed = [
        key(tenant="team-b"),
        key(model="n"),
        key(version=2),
        key(payload=b"\x01" + b"\x00" * 7),
        key(inputs=[TensorHeader("IN", "FP32", (2, 1), 8)]),
        key(outputs=["OTHER"]),
        key(classes={"OUT": 3}),
        key(parameters={"temperature": 0.5}),
    ]
    assert key() == key() and key() not in changed
    assert len(set(changed)) == len(changed)


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("SLUICE_RESPONSE_CACHE_BYTES", "-1"),
        ("SLUICE_RESPONSE_CACHE_TTL_S", "0"),
        ("SLUICE_RESPONSE_CACHE_SHARDS", "-1"),
        ("SLUICE_RESPONSE_CACHE_SHARDS", "4096"),
    ],
)
def test_bad_cache_settings_name_the_setting(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str
) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(ValueError, match=variable.removeprefix("SLUICE_").lower()):
        GatewaySettings()


def test_shards_split_the_room_and_each_keeps_its_own_order(
    redis_server: RedisServer, keys: Keys, sync_redis: Redis
) -> None:
    """Four shards of 1,000 bytes: every answer is found in the shard of its key; a shard
    that fills evicts its own least recently used, not another shard's; an answer larger
    than one shard's part of the room is not kept."""
    reply, payload = _answer(300)
    names = [f"{n:08x}" for n in range(12)]  # (shard = the first 8 hex digits mod 4)

    async def steps(cache: ResponseCache) -> Any:
        assert cache.shards == 4
        kept = [await cache.put(name, pack_answer(reply, payload)) for name in names]
        found = [await cache.get(name) is not None for name in names]
        too_large = await cache.put("0000000c", pack_answer(*_answer(1_000)))
        return kept, found, too_large

    async def main() -> Any:
        client = AsyncRedis.from_url(redis_server.url)
        try:
            return await steps(ResponseCache(client, keys, 4_000, 60, shards=4))
        finally:
            await client.aclose()

    kept, found, too_large = asyncio.run(main())
    assert all(kept) and not too_large
    # Three answers of about 330 bytes went to each shard of 1,000: two fit, so the first
    # of each shard (names 0 to 3) was evicted by the third (names 8 to 11).
    assert found == [False] * 4 + [True] * 8
    for shard in range(4):
        members = sync_redis.zrange(keys.cache_index(shard), 0, -1)
        assert members == [names[shard + 4].encode(), names[shard + 8].encode()]
    assert len({keys.cache_index(shard) for shard in range(4)}) == 4


def test_the_shards_follow_the_redis_they_live_in() -> None:
    settings = GatewaySettings(response_cache_bytes=1 << 20)
    plain = ResponseCache.from_settings(None, Keys("n"), settings, "redis://h:6379/0")  # type: ignore[arg-type]
    cluster = ResponseCache.from_settings(None, Keys("n"), settings, "redis+cluster://h:7000")  # type: ignore[arg-type]
    assert plain is not None and plain.shards == 1
    assert cluster is not None and cluster.shards == 16
    chosen = GatewaySettings(response_cache_bytes=1 << 20, response_cache_shards=3)
    three = ResponseCache.from_settings(None, Keys("n"), chosen, "redis+cluster://h:7000")  # type: ignore[arg-type]
    assert three is not None and three.shards == 3
    none = GatewaySettings(response_cache_bytes=0)
    assert ResponseCache.from_settings(None, Keys("n"), none, "redis://h") is None  # type: ignore[arg-type]
