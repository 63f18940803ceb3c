"""Tenant streams against a real Redis: the gateway makes one known (group, set, wake-up),
the worker's intake reads it from then on with its level's base stream, and the helpers
that every queue reader uses count it."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any, cast

import pytest
from redis import Redis as SyncRedis
from redis.asyncio import Redis

from sluice.core.config.parse import parse_config_text
from sluice.core.keys import WORKER_GROUP, Keys, base_stream
from sluice.core.queue_streams import (
    REGISTER,
    TenantStreams,
    base_streams,
    levels_of,
    register_sync,
    tenant_members_sync,
    with_tenants,
)
from sluice.core.settings import WorkerSettings
from sluice.core.wire import RequestMessage, TensorHeader, encode_request
from sluice.scheduler.executor.redis_server import RedisServer
from sluice.workers.adaptive import ArrivalRate
from sluice.workers.fair_share import FairShare
from sluice.workers.intake import StreamIntake

MODEL = "m"
CONFIG = parse_config_text(
    """
name: "m"
backend: "python"
max_batch_size: 8
input [ { name: "x" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "y" data_type: TYPE_FP32 dims: [ 4 ] } ]
dynamic_batching { priority_levels: 2 default_priority_level: 2 }
""",
    model_name=MODEL,
)


def entry(tenant: str) -> dict[bytes, bytes]:
    message = RequestMessage(
        f"k-{uuid.uuid4().hex[:6]}",
        "reply",
        [TensorHeader("x", "FP32", (1, 4), 16)],
        ["y"],
        tenant=tenant,
    )
    return encode_request(message, b"\0" * 16)


@pytest.fixture
def keys() -> Keys:
    return Keys(f"t{uuid.uuid4().hex[:8]}")


def test_a_tenants_stream_is_named_after_its_levels_base_stream(keys: Keys) -> None:
    base = keys.request_stream(MODEL, 1, 2)
    mine = keys.request_stream(MODEL, 1, 2, "team-a")
    assert mine == f"{base}:t:team-a" and base_stream(mine) == base
    assert keys.request_stream(MODEL, 1, 2, "") == base
    assert base_stream(keys.background_stream(MODEL, 1, "b")) == keys.background_stream(MODEL, 1)
    odd = Keys("ns").request_stream("a:t:b", 1)  # a model's name may hold the mark
    assert base_stream(odd) == odd


def test_the_helpers_put_each_tenant_stream_in_its_level(keys: Keys) -> None:
    bases = base_streams(keys, MODEL, 1, 2)  # p1, p2, bg
    members = [
        keys.request_stream(MODEL, 1, 2, "b"),
        keys.background_stream(MODEL, 1, "a"),
        keys.request_stream(MODEL, 1, 1, "a"),
        keys.request_stream(MODEL, 2, 1, "a"),  # another version's: not ours
    ]
    streams = with_tenants(bases, members)
    assert streams == [
        bases[0],
        members[2],
        bases[1],
        members[0],
        bases[2],
        members[1],
    ]
    levels = levels_of(bases, streams)
    assert [levels[s] for s in streams] == [0, 0, 1, 1, 2, 2]


def test_registering_creates_the_group_lists_the_stream_and_wakes_the_workers_once(
    redis_server: RedisServer, keys: Keys
) -> None:
    client = SyncRedis.from_url(redis_server.url)
    stream = keys.background_stream(MODEL, 1, "team-a")
    base = keys.background_stream(MODEL, 1)
    register_sync(client, keys, MODEL, 1, stream)
    register_sync(client, keys, MODEL, 1, stream)  # known: no second wake-up
    assert [g["name"] for g in client.xinfo_groups(stream)] == [WORKER_GROUP.encode()]
    assert tenant_members_sync(client, keys, [(MODEL, 1)]) == {(MODEL, 1): [stream]}
    assert client.xlen(base) == 1
    register_sync(client, keys, MODEL, 1, base)  # a base stream needs nothing
    assert client.xlen(base) == 1
    client.close()


async def test_a_gateway_process_makes_a_stream_known_once_until_it_forgets(
    redis_server: RedisServer, keys: Keys
) -> None:
    redis = Redis.from_url(redis_server.url)
    calls: list[list[str]] = []
    script = redis.register_script(REGISTER)

    async def counting(keys: list[str], args: list[str]) -> Any:
        calls.append(keys)
        return await script(keys=keys, args=args)

    known = TenantStreams()
    stream = keys.request_stream(MODEL, 1, 1, "team-a")
    use = cast(Any, counting)
    await known.ensure(use, keys, MODEL, 1, stream, "run-1")
    await known.ensure(use, keys, MODEL, 1, stream, "run-1")
    await known.ensure(use, keys, MODEL, 1, keys.request_stream(MODEL, 1, 1), "run-1")
    assert len(calls) == 1
    await known.ensure(use, keys, MODEL, 1, stream, "run-2")  # Redis restarted
    assert len(calls) == 2
    await redis.aclose()


async def test_the_intake_reads_a_new_tenant_stream_after_its_wake_up(
    redis_server: RedisServer, keys: Keys
) -> None:
    redis = Redis.from_url(redis_server.url)
    client = SyncRedis.from_url(redis_server.url)
    streams = base_streams(keys, MODEL, 1, 2)
    intake = StreamIntake(
        redis,
        keys,
        WorkerSettings(),
        CONFIG,
        1,
        "worker-1",
        streams,
        cast(Any, None),  # (no answer to publish: every entry fits)
        ArrivalRate(),
        asyncio.Event(),
    )
    intake.fair_share = FairShare()
    await intake.ensure_groups()
    client.hset(keys.tenant_weights, mapping={"team-a": "3", "*": "2"})
    tenant_stream = keys.request_stream(MODEL, 1, 2, "team-a")
    register_sync(client, keys, MODEL, 1, tenant_stream)
    client.xadd(tenant_stream, entry("team-a"))  # type: ignore[arg-type]

    woken = await intake.read(8, 200)
    assert woken == []  # the wake-up entry, deleted unread
    assert client.xlen(streams[1]) == 0
    assert tenant_stream in intake.all_streams
    assert intake.fair_share.weights == {"team-a": 3.0, "*": 2.0}

    read = await intake.read(8, 200)
    assert [(r.stream, r.level, r.message.tenant) for r in read] == [(tenant_stream, 1, "team-a")]

    # Held entries stay within about two batches per stream: none more from a full one.
    client.xadd(tenant_stream, entry("team-a"))  # type: ignore[arg-type]
    assert await intake.top_up(1, {tenant_stream: 1}) == []
    assert len(await intake.top_up(1, {})) == 1
    client.close()
    await redis.aclose()
