"""The periodic refresh: catalog, readiness and queue depths from Redis, the Redis clock
and memory, this gateway's report, the host's client shared memory regions, the log
settings changed through any gateway and the tenant limits (their file's changes, the other
gateways' counts); it notices Redis going away or restarting."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from typing import Any, TypeVar

from redis.exceptions import RedisError

from sluice.core.dispatch import RedisDispatcher
from sluice.core.errors import Unavailable
from sluice.gateway.control.gateway_report import report
from sluice.gateway.control.log_settings import follow_log_settings
from sluice.gateway.state import GatewayState
from sluice.gateway.tenants.sync import follow_tenant_limits

log = logging.getLogger(__name__)

T = TypeVar("T")

_TOUCH_EVERY = 20
"""Catalog refreshes between two renewals of the reply stream's expiry."""


async def refresh(state: GatewayState, dispatcher: RedisDispatcher, touch: bool) -> None:
    """Catalog, readiness and queue depths from Redis; notices Redis going away or
    restarting (a new run id: the queued requests are gone with it), and fails the
    requests waiting here at once instead of at their deadlines.

    The steps that do not need each other's results go together (two rounds of
    concurrent reads instead of a dozen round trips one after the other): an idle gateway
    wakes itself and Redis a few times per refresh instead of once per step."""
    try:
        control = state.control
        timed = _timed(control.server_identity())
        run_id, round_trip_s = (
            await _together(
                timed,
                control.sync_clock(),  # (the deadlines it writes are read on other hosts)
                control.refresh_catalog(state.view),
                control.refresh_room(state.redis_room),
            )
        )[0]
        state.admission.observe(state.view.depths)
        await _together(
            control.refresh_routing(state.view),
            report(state, dispatcher.gateway_id, round_trip_s),
            *([dispatcher.touch()] if touch else []),
            state.regions.catch_up(),  # (and renews the host's client regions)
            follow_log_settings(state),
            follow_tenant_limits(state, dispatcher.gateway_id),
        )
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
    finally:
        state.refreshed.set()


async def _timed(step: Awaitable[T]) -> tuple[T, float]:
    started = time.perf_counter()
    result = await step
    return result, time.perf_counter() - started


async def _together(*steps: Awaitable[Any]) -> list[Any]:
    """Run ``steps`` concurrently, each to its end; the first one's error is raised once
    all are done (so none is left running or with an error nobody reads)."""
    results = await asyncio.gather(*steps, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results


async def refresh_loop(state: GatewayState, dispatcher: RedisDispatcher) -> None:
    """Refresh every ``catalog_refresh_s`` (the lifespan made the first refresh); while no
    request arrives, every ``catalog_idle_refresh_s``, sleeping until then (or until the
    next request arrives) instead of waking to find nothing new."""
    settings = state.settings
    admission = state.admission
    ticks, arrived, refreshed_at = 1, admission.arrived, time.monotonic()
    while True:
        await asyncio.sleep(settings.catalog_refresh_s)
        if admission.arrived == arrived and not admission.in_flight:
            admission.arrival.clear()  # (no await since the look: no arrival is missed)
            due_in = refreshed_at + settings.catalog_idle_refresh_s - time.monotonic()
            if due_in > 0 and await _arrives_within(admission.arrival, due_in):
                continue  # back at the busy pace: refreshed at the next tick
        arrived, refreshed_at = admission.arrived, time.monotonic()
        await refresh(state, dispatcher, touch=ticks % _TOUCH_EVERY == 0)
        ticks += 1


async def _arrives_within(arrival: asyncio.Event, seconds: float) -> bool:
    try:
        await asyncio.wait_for(arrival.wait(), seconds)
    except TimeoutError:
        return False
    return True
