"""Expired uploads and batch jobs leave the batch store from every gateway process too
(:class:`sluice.core.batch_jobs.sweeper.StoreSweeper`, every ``SLUICE_STORE_SWEEP_S``), not only
from the batch workers: a deployment without batch workers still gets its uploads' room
back. Each item is taken by one sweeper only, however many run."""

from __future__ import annotations

import asyncio
import logging

from sluice.core.batch_jobs.sweeper import StoreSweeper
from sluice.core.redis_client.connect import connect
from sluice.gateway.jobs.upload_routes import batch_data
from sluice.gateway.state import GatewayState

log = logging.getLogger(__name__)


async def store_sweep_loop(state: GatewayState) -> None:
    """Until cancelled; returns at once without a batch store. The sweeps run on a thread
    (their Redis client and the store's calls block), with a client of their own."""
    store = batch_data(state).store
    if store is None:
        return
    settings = state.settings
    client = connect(
        settings.redis_url,
        socket_timeout=settings.redis_timeout_s,
        socket_connect_timeout=settings.redis_timeout_s,
    )
    sweeper = StoreSweeper(client, state.keys, store)
    try:
        while True:
            try:
                await asyncio.to_thread(sweeper.sweep_all)
            except Exception:
                log.exception("removing expired uploads and batch jobs failed")
            await asyncio.sleep(settings.store_sweep_s)
    finally:
        client.close()
