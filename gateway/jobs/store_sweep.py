"""Expired uploads and batch jobs leave the batch store from every gateway process too
(:class:`sluice.core.batch_jobs.sweeper.StoreSweeper`, every ``SLUICE_STORE_SWEEP_S``), not only
from the batch workers: a deployment without batch workers still gets its uploads' room
back. Each item is taken by one sweeper only, however many run. The same sweeper removes
a batch job its tenant deletes (``DELETE /v2/batches/{id}``)."""

from __future__ import annotations

import asyncio
import logging

from sluice.core.batch_jobs.sweeper import StoreSweeper
from sluice.core.redis_client.connect import connect
from sluice.gateway.jobs.upload_routes import batch_data
from sluice.gateway.state import GatewayState

log = logging.getLogger(__name__)

_SWEEPERS: dict[int, StoreSweeper] = {}


def store_sweeper(state: GatewayState) -> StoreSweeper:
    """This gateway process's sweeper (made once): its calls block, so they run on a thread,
    with a Redis client of their own."""
    settings = state.settings
    sweeper = _SWEEPERS.get(id(settings))
    if sweeper is None:
        client = connect(
            settings.redis_url,
            socket_timeout=settings.redis_timeout_s,
            socket_connect_timeout=settings.redis_timeout_s,
        )
        sweeper = StoreSweeper(client, state.keys, batch_data(state).store)
        _SWEEPERS[id(settings)] = sweeper
    return sweeper


async def store_sweep_loop(state: GatewayState) -> None:
    """Until cancelled; returns at once without a batch store."""
    if batch_data(state).store is None:
        return
    sweeper = store_sweeper(state)
    try:
        while True:
            try:
                await asyncio.to_thread(sweeper.sweep_all)
            except Exception:
                log.exception("removing expired uploads and batch jobs failed")
            await asyncio.sleep(state.settings.store_sweep_s)
    finally:
        _SWEEPERS.pop(id(state.settings), None)
        sweeper.redis.close()
