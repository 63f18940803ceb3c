"""The executor's tick loop: every step of ``sluice up``'s upkeep, each guarded, so that one
unexpected error is logged with its trace and the executor goes on (as the controller does):
one bad tick must not stop every child ``sluice up`` runs."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

from redis.exceptions import RedisError

log = logging.getLogger("sluice.up")

Tick = Callable[[], object]

TICK_S = 0.1


def guarded(tick: Tick) -> None:
    """Run one step; a Redis error is a warning (Redis comes back, the next tick retries),
    anything else is logged with its traceback."""
    try:
        tick()
    except RedisError as exc:
        log.warning("Redis: %s", exc)
    except Exception:
        log.exception("an executor tick failed (%s); going on", _name(tick))


def run_ticks(ticks: Sequence[Tick], stop: threading.Event, every_s: float = TICK_S) -> None:
    """Run every step in order, every ``every_s`` seconds, until ``stop`` is set."""
    while not stop.wait(every_s):
        for tick in ticks:
            guarded(tick)


def _name(tick: Tick) -> str:
    return getattr(tick, "__qualname__", None) or repr(tick)
