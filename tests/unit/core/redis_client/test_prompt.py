"""Commands written to Redis at once (sluice.core.redis_client.prompt), against a real
redis-server: before the event loop turns, large ones through the socket's back-pressure,
and on a connection the server closed, as redis-py's own path would."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from redis.asyncio import Redis
from redis.asyncio.connection import Connection, SSLConnection, UnixDomainSocketConnection
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError

from sluice.core.redis_client.connect import connect, connect_async
from sluice.core.redis_client.prompt import (
    PromptConnection,
    PromptSSLConnection,
    PromptUnixConnection,
    prompt_class_for,
)
from sluice.scheduler.executor.redis_server import RedisServer


@pytest.fixture
async def client(redis_server: RedisServer) -> AsyncIterator[Redis]:
    redis = connect_async(
        redis_server.url,
        socket_timeout=5,
        retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
    )
    await redis.ping()
    yield redis
    await redis.aclose()


def only_connection(redis: Redis) -> Any:
    [connection] = redis.connection_pool._available_connections
    return connection


async def test_a_command_is_written_before_the_event_loop_turns(client: Redis) -> None:
    connection = only_connection(client)
    assert isinstance(connection, PromptConnection)
    events: list[str] = []
    writer = connection._writer
    write = writer.writelines

    def logged(data: Any) -> None:
        events.append("written")
        write(data)

    writer.writelines = logged
    asyncio.get_running_loop().call_soon(events.append, "a turn of the loop")
    async with client.pipeline(transaction=False) as pipe:
        pipe.set("prompt:key", "value")
        pipe.get("prompt:key")
        assert await pipe.execute() == [True, b"value"]
    assert events == ["written", "a turn of the loop"]


async def test_a_command_larger_than_the_socket_takes_at_once_is_sent_whole(
    client: Redis,
) -> None:
    value = b"x" * (48 << 20)
    assert await client.set("prompt:large", value)
    assert await client.strlen("prompt:large") == len(value)
    await client.delete("prompt:large")


async def test_a_connection_the_server_closed_is_opened_again(
    client: Redis, redis_server: RedisServer
) -> None:
    await client.set("prompt:kept", "1")
    connection_id = await client.client_id()
    with connect(redis_server.url) as other:
        assert other.client_kill_filter(_id=connection_id) == 1
    # (written on the closed connection, failed, and sent again on a new one by the retry)
    assert await client.get("prompt:kept") == b"1"
    assert await client.client_id() != connection_id


def test_every_kind_of_url_gets_its_prompt_connection() -> None:
    assert prompt_class_for("redis://127.0.0.1:6379/0") is PromptConnection
    assert prompt_class_for("rediss://127.0.0.1:6379/0") is PromptSSLConnection
    assert prompt_class_for("unix:///tmp/redis.sock") is PromptUnixConnection
    assert issubclass(PromptSSLConnection, SSLConnection)
    assert issubclass(PromptUnixConnection, UnixDomainSocketConnection)
    assert issubclass(PromptConnection, Connection)


def test_a_cluster_client_makes_prompt_connections_to_every_node() -> None:
    cluster = connect_async("redis+cluster://127.0.0.1:7000")  # (connects at its first command)
    assert cluster.connection_kwargs["connection_class"] is PromptConnection  # type: ignore[attr-defined]
    nodes = cluster.nodes_manager.startup_nodes.values()  # type: ignore[attr-defined]
    assert {node.connection_class for node in nodes} == {PromptConnection}
