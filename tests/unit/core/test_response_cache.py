"""The response cache's scripts on a real Redis (:mod:`sluice.core.response_cache`): a
kept answer comes back whole, the least recently used go first when room is needed, an
answer larger than the cache is not kept (nor sent), answers unused past their time expire
and the bookkeeping after the last of them, keeping the same key again replaces it, the
room bounds Redis's memory however small the answers, and the key tells tenants, catalog
revisions, inputs, outputs and parameters apart."""

from __future__ import annotations

import asyncio
import math
import uuid
from collections.abc import Iterator
from typing import Any, cast

import pytest
from redis import Redis
from redis.asyncio import Redis as AsyncRedis

from sluice.core.keys import Keys
from sluice.core.response_cache import (
    CacheLookup,
    ResponseCache,
    digest,
    pack_answer,
    unpack_answer,
)
from sluice.core.settings import GatewaySettings
from sluice.core.wire import ReplyMessage, RequestMessage, TensorHeader
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


def _size(key: str, value: bytes, keys: Keys) -> int:
    """What ``value`` counts for under ``key`` (with what Redis spends on its keys)."""
    return ResponseCache(cast(AsyncRedis, None), keys, 1, 60).size_of(key, value)


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
    size = ResponseCache(cast(AsyncRedis, None), keys, 1, 60).size_of("a", values["a"])

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
    assert _total(sync_redis, keys) == _size("new", value, keys)
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
    assert _total(sync_redis, keys) == _size("same", second, keys)


def test_the_key_tells_requests_apart() -> None:
    def key(**changes: Any) -> str:
        request: dict[str, Any] = {
            "tenant": "team-a",
            "model": "m",
            "version": 1,
            "revision": "7",
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
        key(revision="8"),
        # Values JSON writes alike (NaN and both infinities as null), or that differ in type.
        *(key(parameters={"t": value}) for value in (math.nan, math.inf, -math.inf)),
        *(key(parameters={"t": value}) for value in (1, 1.0, True, "1", 0.0, -0.0)),
    ]
    assert key() == key() and key() not in changed
    assert len(set(changed)) == len(changed)


def _request(value: bytes) -> RequestMessage:
    tensor = TensorHeader("IN", "UINT8", (1, len(value)), len(value))
    return RequestMessage("", "", [tensor], ["OUT"], "", 0, 0, 0)


def test_an_answer_kept_before_a_load_is_never_served_after_it(redis_server: RedisServer) -> None:
    """The catalog's revision moves on every load and unload: a model reloaded with new
    weights (same name and version) never gets the answers its former self gave."""
    reply, payload = _answer(10)

    async def steps(cache: ResponseCache) -> Any:
        async def lookup(revision: str) -> CacheLookup:
            request = _request(b"same")
            return await CacheLookup.start(
                cache, "", "m", 1, revision, request, b"same", False, 1 << 16
            )

        before = await lookup("1")
        assert before.hit is None
        await before.keep(reply, memoryview(payload), 1 << 16, "stats")
        return (await lookup("1")).hit is not None, (await lookup("2")).hit is not None

    assert _run(redis_server, Keys(f"rev{uuid.uuid4().hex[:8]}"), 10_000, 60, steps) == (
        True,
        False,
    )


def test_a_payload_larger_than_its_body_is_hashed_off_the_event_loop(
    redis_server: RedisServer, keys: Keys, monkeypatch: pytest.MonkeyPatch
) -> None:
    """JSON numbers take fewer bytes than the tensors they make: the key of a small body's
    large payload is computed on a thread, as a large body's."""
    threaded: list[Any] = []
    to_thread = asyncio.to_thread

    async def spy(work: Any, *args: Any) -> Any:
        threaded.append(work)
        return await to_thread(work, *args)

    monkeypatch.setattr(asyncio, "to_thread", spy)
    payload = b"\x00" * 4096

    async def steps(cache: ResponseCache) -> Any:
        for size in (100, 4096):
            await CacheLookup.start(
                cache, "", "m", 1, "1", _request(payload[:size]), payload[:size], False, 1024
            )
        return len(threaded)

    assert _run(redis_server, keys, 10_000, 60, steps) == 1  # (the small one on the loop)


def test_a_hit_is_read_without_copying_its_bytes() -> None:
    value = pack_answer(*_answer(1000))
    _, data = unpack_answer(value)
    assert data.obj is value and len(data) == 1000


def test_an_answer_larger_than_the_room_is_never_sent(
    redis_server: RedisServer, keys: Keys, sync_redis: Redis
) -> None:
    """Redis would hold it whole in its buffers before the script refused it."""
    sent: list[Any] = []
    big = pack_answer(*_answer(5000))

    async def steps(cache: ResponseCache) -> Any:
        submit = cache.submit

        def spy(op: Any, future: Any = None) -> Any:
            sent.append(op[0])
            return submit(op, future)

        cache.submit = spy  # type: ignore[method-assign]
        kept = await cache.put("big", big)
        lookup = CacheLookup(cache, "big2", 0, 0, None)
        reply, payload = _answer(5000)  # (not even packed)
        await lookup.keep(reply, memoryview(payload), 1 << 20, keys.stats("m", 1))
        return kept

    assert _run(redis_server, keys, 4000, 60, steps) is False
    assert "put" not in sent and sent == ["count"]  # (the miss is still counted)


def test_the_room_bounds_what_redis_spends_on_small_answers(
    redis_server: RedisServer, keys: Keys, sync_redis: Redis
) -> None:
    """Each answer counts with what Redis spends on its keys: many small answers take about
    the cache's bytes of Redis's memory, not many times that."""
    room = 1 << 20
    value = pack_answer(*_answer(4))

    def fill(count: int) -> Any:
        async def steps(cache: ResponseCache) -> Any:
            names = [f"{n:064x}" for n in range(count)]
            for start in range(0, count, 500):
                await asyncio.gather(*(cache.put(n, value) for n in names[start : start + 500]))

        return steps

    # (Redis's first scripts cost it a fixed amount: spent in another namespace first)
    _run(redis_server, Keys(f"warm{uuid.uuid4().hex[:8]}"), 1 << 16, 1, fill(1000))
    before = sync_redis.info("memory")["used_memory"]
    _run(redis_server, keys, room, 60, fill(8000))
    used = sync_redis.info("memory")["used_memory"] - before
    assert 0 < _total(sync_redis, keys) <= room
    assert used < 1.25 * room, f"{used} bytes of Redis for a cache of {room}"


def test_the_bookkeeping_expires_with_the_last_answer(
    redis_server: RedisServer, keys: Keys, sync_redis: Redis
) -> None:
    """The index, the sizes and the total live as long as the answer kept or used last,
    and no longer: every store has an expiry."""
    value = pack_answer(*_answer(10))
    index = keys.cache_index()
    bookkeeping = (index, f"{index}:sizes", f"{index}:total")

    async def steps(cache: ResponseCache) -> Any:
        assert await cache.put("a", value)
        kept = [sync_redis.pttl(key) for key in bookkeeping]
        await asyncio.sleep(0.2)
        assert await cache.get("a") is not None  # (a hit: the answer and its bookkeeping)
        used = [sync_redis.pttl(key) for key in bookkeeping]
        await asyncio.sleep(0.5)  # past the time to live of both
        return kept, used

    kept, used = _run(redis_server, keys, 10_000, 0.4, steps)
    assert all(0 < ttl <= 400 for ttl in kept + used), (kept, used)
    assert min(used) > max(kept) - 200  # renewed by the hit
    assert not any(sync_redis.exists(key) for key in bookkeeping)


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("SLUICE_RESPONSE_CACHE_BYTES", "-1"),
        ("SLUICE_RESPONSE_CACHE_TTL_S", "0"),
        ("SLUICE_RESPONSE_CACHE_TTL_S", "inf"),  # (no int: the gateway failed to start)
        ("SLUICE_RESPONSE_CACHE_TTL_S", "1e30"),  # (Redis refused every expiry)
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
    """Four shards of 2,000 bytes: every answer is found in the shard of its key; a shard
    that fills evicts its own least recently used, not another shard's; an answer larger
    than one shard's part of the room is not kept."""
    reply, payload = _answer(300)
    names = [f"{n:08x}" for n in range(12)]  # (shard = the first 8 hex digits mod 4)

    async def steps(cache: ResponseCache) -> Any:
        assert cache.shards == 4
        kept = [await cache.put(name, pack_answer(reply, payload)) for name in names]
        found = [await cache.get(name) is not None for name in names]
        too_large = await cache.put("0000000c", pack_answer(*_answer(2_000)))
        return kept, found, too_large

    async def main() -> Any:
        client = AsyncRedis.from_url(redis_server.url)
        try:
            return await steps(ResponseCache(client, keys, 8_000, 60, shards=4))
        finally:
            await client.aclose()

    kept, found, too_large = asyncio.run(main())
    assert all(kept) and not too_large
    # Three answers of about 720 bytes (with their keys) went to each shard of 2,000: two
    # fit, so the first of each shard (names 0 to 3) was evicted by the third (8 to 11).
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
