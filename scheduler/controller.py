"""The controller's loop: lead through the lease, or stand by until the leader is gone.

Several controllers may run; one leads (see :mod:`scheduler.leadership`) and calls
``tick`` about every second; the others wait and take over within the lease's lifetime
of the leader's death. A leader stops ticking as soon as its lease may have lapsed or a
renewal or fenced write is refused, and goes back to standby.

The decisions themselves (loading, unloading, scaling) come later. Until then
``python -m scheduler.controller`` records one fenced demonstration decision per tick in
``Keys.controller_decisions`` and prints ``leading <token>`` for each, which the fault
tests read.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
import time
from collections.abc import Callable

from redis import Redis
from redis.exceptions import RedisError

from scheduler.leadership import Lease, Write
from sluice.keys import Keys
from sluice.logs import configure_logging
from sluice.settings import ControllerSettings

log = logging.getLogger("scheduler.controller")

TICK_S = 1.0
DECISIONS_KEPT = 10_000
"""The demonstration decision log is trimmed to its newest entries."""

Hook = Callable[[Lease], object]
"""Called with the lease, whose ``token`` and ``apply`` make fenced decisions."""


def run_controller(
    settings: ControllerSettings,
    stop_event: threading.Event,
    on_lead: Hook,
    tick: Hook,
    *,
    tick_s: float = TICK_S,
) -> None:
    """Lead or stand by until ``stop_event`` is set; then give the lease up. ``on_lead``
    runs once per leadership, ``tick`` every ``tick_s`` while leading; both must return
    well within the lease's lifetime."""
    redis = Redis.from_url(
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
    """Run ``hook``; a Redis error is logged: the lease decides whether we still lead."""
    try:
        hook(lease)
    except RedisError as exc:
        log.warning("Redis error while leading: %s", exc)


class DemoDecisions:
    """One fenced decision per tick: ``<token>:<n>`` appended to the decision log."""

    def __init__(self, keys: Keys) -> None:
        self.key = keys.controller_decisions
        self.count = 0

    def on_lead(self, lease: Lease) -> None:
        self.count = 0

    def tick(self, lease: Lease) -> None:
        token = lease.token
        if token is None:
            return
        self.count += 1
        decision = f"{token}:{self.count}"
        writes = [
            Write("RPUSH", self.key, (decision,)),
            Write("LTRIM", self.key, (-DECISIONS_KEPT, -1)),
        ]
        if lease.apply(writes):
            print(f"leading {token}", flush=True)
        else:
            log.warning("decision %s refused: token %d is no longer current", decision, token)


def main() -> int:
    settings = ControllerSettings()
    configure_logging("controller", settings)
    stop_event = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop_event.set())
    demo = DemoDecisions(Keys(settings.namespace))
    run_controller(settings, stop_event, demo.on_lead, demo.tick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
