"""Removing the shared memory segments nobody will unlink (see
:func:`sluice.core.shm.sweep_orphans`): periodically while the gateway runs, and once as it
stops."""

from __future__ import annotations

import asyncio
import logging

from sluice.core.shm import sweep_orphans
from sluice.gateway.state import GatewayState

log = logging.getLogger(__name__)


def longest_timeout_s(state: GatewayState) -> float:
    """The longest deadline a request can get (setting or model queue policy)."""
    longest = state.settings.default_timeout_s
    for entry in state.view.models.values():
        dynamic = entry.config.dynamic_batching if entry.config is not None else None
        if dynamic is not None:
            longest = max(longest, dynamic.default_timeout_us / 1e6)
    return longest


def orphan_age_s(state: GatewayState) -> float:
    """The age past which an answer segment is an orphan: twice the longest deadline, so
    that no reader still within its deadline loses its segment."""
    return 2 * longest_timeout_s(state)


def sweep_now(state: GatewayState, *, final: bool = False) -> list[str]:
    """Remove the orphans; ``final``: the gateway stops, no grace for its own segments."""
    if final:
        return sweep_orphans(state.settings.namespace, orphan_age_s(state), grace_s=0)
    return sweep_orphans(state.settings.namespace, orphan_age_s(state))


async def sweep_loop(state: GatewayState) -> None:
    """Remove shared memory segments whose creator died, or whose reader gave up."""
    while True:
        try:
            await asyncio.to_thread(sweep_now, state)
        except Exception:
            log.exception("sweeping shared memory segments failed")
        await asyncio.sleep(state.settings.shm_sweep_interval_s)
