"""Lead or stand by: a controller contends for the lease, ticks while it leads, and goes
back to standby as soon as its lease may have lapsed (see :mod:`.leadership`)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from redis.exceptions import RedisError

from sluice.core.keys import Keys
from sluice.core.redis_client.connect import connect
from sluice.core.settings import ControllerSettings
from sluice.scheduler.controller.leadership import Lease

log = logging.getLogger("sluice.scheduler.controller")

TICK_S = 1.0
Hook = Callable[[Lease], object]
"""Called with the lease, whose ``token`` and ``apply`` make fenced decisions."""


def run_controller(
    settings: ControllerSettings,
    stop_event: threading.Event,
    on_lead: Hook,
    tick: Hook,
    *,
    on_lose: Hook | None = None,
    tick_s: float = TICK_S,
) -> None:
    """Lead or stand by until ``stop_event`` is set; then give the lease up. ``on_lead``
    runs once per leadership, ``tick`` every ``tick_s`` while leading, ``on_lose`` when a
    leadership ends; each must return well within the lease's lifetime."""
    redis = connect(
        settings.redis_url,
        socket_timeout=settings.lease_renew_s,
        socket_connect_timeout=settings.lease_renew_s,
    )
    lease = Lease(
        redis, Keys(settings.namespace), settings.controller_id, ttl_s=settings.lease_ttl_s
    )
    if settings.lease_renew_s >= lease.ttl_s - lease.margin_s:
        raise ValueError(
            f"lease_renew_s ({settings.lease_renew_s}) must be well below "
            f"lease_ttl_s ({settings.lease_ttl_s})"
        )
    logged_holder = ""
    try:
        while not stop_event.is_set():
            try:
                claim = lease.acquire()
            except RedisError as exc:
                log.warning("cannot reach Redis to take the lease: %s", exc)
                stop_event.wait(settings.lease_renew_s)
                continue
            if claim.token is None:
                if claim.holder != logged_holder:
                    log.info("standby: %s leads", claim.holder)
                    logged_holder = claim.holder
                wait_s = settings.lease_renew_s
                if claim.expires_in_s >= 0:  # try again right when the lease runs out
                    wait_s = min(wait_s, claim.expires_in_s + 0.01)
                stop_event.wait(wait_s)
                continue
            logged_holder = ""
            log.info("leading with token %d", claim.token)
            _guarded(on_lead, lease)
            _lead(lease, settings.lease_renew_s, stop_event, tick, tick_s)
            if on_lose is not None:
                _guarded(on_lose, lease)
            if not stop_event.is_set():
                log.warning("lost the lease (token %d)", claim.token)
    finally:
        try:
            lease.release()
        except RedisError as exc:
            log.warning("cannot release the lease (it expires by itself): %s", exc)
        redis.close()


def _lead(
    lease: Lease, renew_s: float, stop_event: threading.Event, tick: Hook, tick_s: float
) -> None:
    """Renew and tick until the lease is lost or ``stop_event`` is set."""
    next_renew = time.monotonic() + renew_s
    next_tick = time.monotonic()
    while not stop_event.is_set():
        now = time.monotonic()
        if now >= next_renew:
            next_renew = now + renew_s
            _guarded(Lease.renew, lease)
        if not lease.is_leader:
            return
        if now >= next_tick:
            next_tick = now + tick_s
            _guarded(tick, lease)
            if not lease.is_leader:
                return
        stop_event.wait(max(0.0, min(next_renew, next_tick) - time.monotonic()))


def _guarded(hook: Hook, lease: Lease) -> None:
    """Run ``hook``; a Redis error is logged: the lease decides whether we still lead. Any
    other error is logged with its trace, and the controller goes on: one bad decision must
    not leave the deployment without a controller."""
    try:
        hook(lease)
    except RedisError as exc:
        log.warning("Redis error while leading: %s", exc)
    except Exception:
        log.exception("the controller failed to decide; going on")
