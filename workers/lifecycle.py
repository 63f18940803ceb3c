"""A worker process's life around its model: patience with Redis at start, and signals.

The exit statuses a worker leaves with live in :mod:`sluice.core.exits`.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

log = logging.getLogger(__name__)

START_PATIENCE_S = 60.0
"""How long a worker whose model has loaded waits out a Redis outage (a restart, a
Cluster failover) before its first beat, rather than exiting and loading it again."""


class Stoppable(Protocol):
    def stop(self) -> None: ...


async def patiently(
    step: Callable[[], Awaitable[object]], patience_s: float = START_PATIENCE_S
) -> None:
    """One start-up step against Redis, tried again while Redis cannot be reached (up to
    ``patience_s``)."""
    deadline = time.monotonic() + patience_s
    while True:
        try:
            await step()
            return
        except (RedisConnectionError, RedisTimeoutError) as exc:
            if time.monotonic() > deadline:
                raise
            log.warning("starting: Redis cannot be reached, trying again: %s", exc)
            await asyncio.sleep(0.5)


def install_signal_handlers(worker: Stoppable) -> None:
    """SIGTERM and SIGINT stop the worker gracefully (it answers what it holds first)."""
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, worker.stop)
