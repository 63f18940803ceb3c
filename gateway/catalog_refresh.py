"""The periodic refresh: catalog, readiness and queue depths from Redis, the Redis clock
and memory, this gateway's report, the host's client shared memory regions, the log
settings changed through any gateway and the tenant limits (their file's changes, the other
gateways' counts); it notices Redis going away or restarting."""

from __future__ import annotations

import asyncio
import logging
import time

from redis.exceptions import RedisError

from sluice.core.dispatch import RedisDispatcher
from sluice.core.errors import Unavailable
from sluice.gateway.gateway_report import report
from sluice.gateway.log_settings import follow_log_settings
from sluice.gateway.state import GatewayState
from sluice.gateway.tenant_sync import follow_tenant_limits

log = logging.getLogger(__name__)

_TOUCH_EVERY = 20
"""Catalog refreshes between two renewals of the reply stream's expiry."""


async def refresh(state: GatewayState, dispatcher: RedisDispatcher, touch: bool) -> None:
    """Catalog, readiness and queue depths from Redis; notices Redis going away or
    restarting (a new run id: the queued requests are gone with it), and fails the
    requests waiting here at once instead of at their deadlines."""
    try:
        started = time.perf_counter()
        run_id = await state.control.server_identity()
        round_trip_s = time.perf_counter() - started
        await state.control.sync_clock()  # (the deadlines it writes are read on other hosts)
        await state.control.refresh_catalog(state.view)
        await state.control.refresh_routing(state.view)
        state.admission.observe(state.view.depths)
        await state.control.refresh_room(state.redis_room)
        await report(state, dispatcher.gateway_id, round_trip_s)
        if touch:
            await dispatcher.touch()
        await state.regions.catch_up()  # (and renews the host's client regions)
        await follow_log_settings(state)
        await follow_tenant_limits(state, dispatcher.gateway_id)
        if state.redis_run_id and run_id != state.redis_run_id:
            log.warning("Redis restarted: failing the requests it lost")
            dispatcher.fail_all(Unavailable("the request queue (Redis) restarted; retry"))
            state.limits_source.weights_written = False  # (written again at the next refresh)
        state.redis_run_id = run_id
        if not state.redis_ok:
            log.info("connected to Redis")
        state.redis_ok = True
    except RedisError as exc:
        if state.redis_ok:
            log.warning("Redis is unreachable: %s", exc)
            dispatcher.fail_all(
                Unavailable("the request queue (Redis) became unreachable; retry later")
            )
        state.redis_ok = False
    except Exception:
        log.exception("catalog refresh failed")


async def refresh_loop(state: GatewayState, dispatcher: RedisDispatcher) -> None:
    """Refresh every ``catalog_refresh_s`` (the lifespan made the first refresh), and every
    ``catalog_idle_refresh_s`` while no request arrives."""
    settings = state.settings
    admission = state.admission
    ticks, arrived, refreshed_at = 1, admission.arrived, time.monotonic()
    while True:
        await asyncio.sleep(settings.catalog_refresh_s)
        idle = admission.arrived == arrived and not admission.in_flight
        if idle and time.monotonic() - refreshed_at < settings.catalog_idle_refresh_s:
            continue
        arrived, refreshed_at = admission.arrived, time.monotonic()
        await refresh(state, dispatcher, touch=ticks % _TOUCH_EVERY == 0)
        ticks += 1
