"""Fixtures shared by every test layer: a private redis-server and Sluice stacks."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from sluice.scheduler.redis_server import RedisServer
from tests.support.redis_cluster import LocalRedisCluster
from tests.support.stack import Stack


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """A redis-server of the tests' own on a free port, killed at the end."""
    server = RedisServer()
    server.start()
    yield server
    server.stop()


@pytest.fixture
def start_stack(redis_server: RedisServer) -> Iterator[Callable[..., Stack]]:
    """Factory: start ``sluice up`` on a repository; every stack is stopped afterwards."""
    stacks: list[Stack] = []

    def start(repository: Path, env: dict[str, str] | None = None) -> Stack:
        stack = Stack(repository, redis_server.url, env=env or {})
        stacks.append(stack)
        stack.start()
        return stack

    yield start
    for stack in stacks:
        stack.stop()


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[LocalRedisCluster]:
    """A Redis Cluster of the tests' own (3 primaries, 3 replicas), stopped at the end."""
    cluster = LocalRedisCluster()
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
