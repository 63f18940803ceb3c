"""Fixtures shared by every test layer: a private redis-server and Sluice stacks."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from sluice.core.observability import logs
from sluice.scheduler.executor.redis_server import RedisServer
from tests.support.redis_cluster import LocalRedisCluster
from tests.support.stack import Stack

_FOLDER_MARKS = {"integration": pytest.mark.integration, "faults": pytest.mark.faults}
"""A marker for every test of these folders of tests/, so that ``-m`` can select a layer."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Marks each test with its layer (its folder). (Run in streams, ``pytest -n 2 --dist
    loadfile`` as scripts/test.sh does, a file's tests stay in one stream, so that a
    module's fixtures, a stack or a cluster, start once.)"""
    tests = Path(__file__).resolve().parent
    for item in items:
        try:
            relative = item.path.resolve().relative_to(tests)
        except ValueError:
            continue
        mark = _FOLDER_MARKS.get(relative.parts[0])
        if mark is not None:
            item.add_marker(mark)


@pytest.fixture(autouse=True)
def _log_handlers_do_not_outlive_their_test() -> Iterator[None]:
    """A command run in-process (typer's CliRunner) may point the root logger at a stream
    the runner closes when it returns; the handlers a test added go with it, so that a later
    test's log lines are not written to a closed stream."""
    root = logging.getLogger()
    before = list(root.handlers)
    yield
    for handler in [h for h in root.handlers if h not in before]:
        root.removeHandler(handler)
    logs._control = None


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
