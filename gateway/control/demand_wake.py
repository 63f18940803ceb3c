"""Waking the executors when a request is queued for an on-demand model no worker serves
(:class:`sluice.core.on_demand.DemandWake`): one wake-up per model version and gateway
process every :data:`sluice.core.on_demand.WAKE_EVERY_S` at most."""

from __future__ import annotations

from sluice.core.on_demand import DemandWake
from sluice.gateway.state import GatewayState

_WAKE = DemandWake()


async def wake_on_demand(state: GatewayState, model: str, version: int) -> None:
    """Wake the executors if ``model``'s ``version`` loads on demand and is not ready."""
    entry = state.view.models.get(model)
    if entry is None or not entry.on_demand or state.view.is_ready(model, version):
        return
    await _WAKE.wake(state.redis, state.keys, model, version)
