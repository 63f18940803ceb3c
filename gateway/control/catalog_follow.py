"""Catching up with the catalog between two periodic refreshes: when another gateway process
of this host changed it (:func:`follow_changes`), and when a request names a model this
process does not know or knows as not ready (:func:`catch_up_on_miss`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import TypeVar

from redis.exceptions import RedisError

from sluice.core.dispatch import RedisDispatcher
from sluice.core.errors import NotFound, Unavailable
from sluice.gateway.control.catalog_refresh import refresh
from sluice.gateway.control.log_settings import follow_log_settings
from sluice.gateway.control.routing_view import UnknownLabel
from sluice.gateway.state import GatewayState

log = logging.getLogger(__name__)

T = TypeVar("T")

MISS_REFRESH_S = 0.05
"""At most one refresh per this many seconds for requests that miss: a client that sends
unknown model names costs Redis nothing more than that."""


async def follow_changes(state: GatewayState) -> None:
    """Catch up with a change another gateway process of this host carried out (it answered
    a load, an unload, a label or split, or log settings, then moved the host's counter), so
    that a client that loads a model through one connection finds it loaded through the
    next. One read of mapped memory when nothing changed. Changes made elsewhere (the
    repository poller, another host) are seen at the next refresh, or by a request that
    misses them (:func:`catch_up_on_miss`)."""
    moved = state.host_changes.value()
    if moved == state.host_seen:
        return
    async with state.host_lock:
        if moved == state.host_seen:
            return
        try:
            await state.control.refresh_catalog(state.view)
            await state.control.refresh_routing(state.view)
            await follow_log_settings(state)
        except RedisError as exc:  # the request goes on with what this process knew
            log.warning("catching up with a model-control change failed: %s", exc)
            return
        state.host_seen = moved


async def catch_up_on_miss(state: GatewayState) -> bool:
    """After an answer of "unknown", "unavailable" or "not ready": whether a refresh made now
    changed what this process knows of the models (then ask again). A model loaded by the
    repository poller or through another host, or a worker that just became ready, is
    served at once rather than after the periodic refresh. Misses share one refresh, and
    come to at most one every :data:`MISS_REFRESH_S`."""
    view = state.view
    before = (view.revision, view.ready, view.load_errors, dict(view.routing.models))
    async with state.host_lock:
        now = time.monotonic()
        if now - state.miss_refreshed_at >= MISS_REFRESH_S:
            state.miss_refreshed_at = now
            try:
                await state.control.refresh_catalog(view)
                await state.control.refresh_routing(view)
            except RedisError as exc:
                log.warning("catching up with the catalog failed: %s", exc)
                return False
    return (view.revision, view.ready, view.load_errors, view.routing.models) != before


def _never(_: object) -> bool:
    return False


def is_problem(problem: str | None) -> bool:
    """For :func:`asked_fresh`: a "not ready" answer (the reason why) missed."""
    return problem is not None


async def asked_fresh(
    state: GatewayState, ask: Callable[[], T], missed: Callable[[T], bool] = _never
) -> T:
    """``ask()``, asked again after :func:`catch_up_on_miss` when it raised "unknown" (a
    model, a version, a label) or "unavailable", or when its answer ``missed`` (not
    ready), and the catalog changed."""
    try:
        answer = ask()
    except (NotFound, Unavailable, UnknownLabel):
        if not await catch_up_on_miss(state):
            raise
        return ask()
    if missed(answer) and await catch_up_on_miss(state):
        return ask()
    return answer


REDIS_CHECK_WAIT_S = 0.25
"""How long the request that starts a look at Redis waits for it: a reachable Redis answers
well within it, and a cut link never holds a request longer."""


async def redis_back(state: GatewayState) -> bool:
    """While this process holds Redis for unreachable: whether it is back, by a refresh made
    now rather than at the next periodic one, so that the gateway processes of a host
    recover together. One look at a time, at most one every :data:`MISS_REFRESH_S`; the
    request that starts it waits at most :data:`REDIS_CHECK_WAIT_S` for it, the others are
    refused at once, as before, without touching Redis."""
    if state.redis_ok:
        return True
    now, dispatcher = time.monotonic(), state.dispatcher
    if state.redis_check is not None and not state.redis_check.done():
        return False  # another request's look is under way
    if now - state.redis_checked_at < MISS_REFRESH_S or not isinstance(dispatcher, RedisDispatcher):
        return False
    state.redis_checked_at = now
    check = asyncio.get_running_loop().create_task(refresh(state, dispatcher, touch=False))
    state.redis_check = check
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(asyncio.shield(check), REDIS_CHECK_WAIT_S)
    return state.redis_ok
