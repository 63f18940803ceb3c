"""Waking the executors when a request is queued for an on-demand model no worker serves.

They would notice at their next tick (a second when idle); the wake-up (an entry on
``Keys.demand_requests``, which each executor's command watcher blocks on) starts the load at
once. One per model version and gateway process every ``WAKE_EVERY_S`` at most: the first
request starts the load, the rest wait for it in the queue.
"""

from __future__ import annotations

import contextlib
import time

from redis.exceptions import RedisError

from sluice.gateway.state import GatewayState

WAKE_EVERY_S = 0.25
_DEMAND_STREAM_MAX_LEN = 1000
_last_wake: dict[tuple[str, int], float] = {}


async def wake_on_demand(state: GatewayState, model: str, version: int) -> None:
    """Wake the executors if ``model``'s ``version`` loads on demand and is not ready."""
    entry = state.view.models.get(model)
    if entry is None or not entry.on_demand or state.view.is_ready(model, version):
        return
    now = time.monotonic()
    key = (model, version)
    if now - _last_wake.get(key, -WAKE_EVERY_S) < WAKE_EVERY_S:
        return
    _last_wake[key] = now
    # (Without it, the request is queued all the same: the executors find it at their tick.)
    with contextlib.suppress(RedisError):
        await state.redis.xadd(
            state.keys.demand_requests,
            {"model": model, "version": str(version)},
            maxlen=_DEMAND_STREAM_MAX_LEN,
            approximate=True,
        )
