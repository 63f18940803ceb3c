"""The controller: lead through the lease and decide, or stand by until the leader is gone.

Several controllers may run (``sluice up`` runs one beside its executor, ``sluice controller``
runs one alone); one leads (see :mod:`scheduler.leadership`) and ticks about every second;
the others wait and take over within the lease's lifetime of the leader's death. A leader
stops ticking as soon as its lease may have lapsed or a renewal or fenced write is refused,
and goes back to standby.

What the leader decides (:class:`Decisions`): poll mode's loads and unloads, rollouts and
their steps, and how many instances each autoscaled model version should have. Executors
(``sluice up``) carry the decisions out; every decision is fenced by the lease and logged in
``Keys.controller_decisions``. A new leader starts from what Redis holds: the rollouts under
way, the wanted instance counts, and the repository listing last acted upon.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from redis import Redis
from redis.exceptions import RedisError

from sluice.core.control import ControlCommand, read_commands, send_reply
from sluice.core.errors import SluiceError
from sluice.core.keys import Keys
from sluice.core.logs import configure_logging
from sluice.core.redis_connect import connect
from sluice.core.rollout import OPS as ROLLOUT_OPS
from sluice.core.settings import ControllerSettings
from sluice.scheduler.autoscaler import Autoscaler
from sluice.scheduler.fenced_commands import CommandSender, served_models
from sluice.scheduler.kubernetes_executor import start_executor
from sluice.scheduler.leadership import Lease
from sluice.scheduler.model_staging import check_model_name
from sluice.scheduler.repository_poller import RepositoryPoller
from sluice.scheduler.rollouts import RolloutManager
from sluice.scheduler.sources import RepositorySource, SourceError, open_source, snapshot_repository

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


class Decisions:
    """Everything a leader decides, made anew for each leadership from what Redis holds."""

    def __init__(
        self,
        client: Redis,
        keys: Keys,
        repository: Path | None,
        source: RepositorySource | None,
        poll_s: float,
        *,
        announce: bool = True,
    ) -> None:
        self.client, self.keys, self.announce = client, keys, announce
        self.repository, self.source, self.poll_s = repository, source, poll_s
        self.leading: tuple[CommandSender, RolloutManager, Autoscaler] | None = None
        self.poller: RepositoryPoller | None = None
        self._last_request = "0-0"

    def on_lead(self, lease: Lease) -> None:
        sender = CommandSender(self.client, self.keys, lease)
        sender.loaded = served_models(self.client, self.keys, self.repository)
        rollouts = RolloutManager(self.client, self.keys, sender)
        rollouts.recover()
        self.leading = (sender, rollouts, Autoscaler(self.client, self.keys, sender))
        self._last_request = "0-0"  # what waits was sent to the previous leader too
        if self.announce:
            print(f"Controller {lease.holder} leads (fencing token {lease.token})", flush=True)

    def tick(self, lease: Lease) -> None:
        if self.leading is None:
            return
        sender, rollouts, autoscaler = self.leading
        sender.loaded = served_models(self.client, self.keys, self.repository)
        # The executors set the mode; they may start after the controller.
        polled = self.source is not None and self.poller is None
        if polled and self.client.get(self.keys.control_mode) == b"poll":
            assert self.source is not None
            self.poller = RepositoryPoller(self.source, sender, self.poll_s, self.client, self.keys)
            self.poller.start()
        self._last_request, requested = read_commands(
            self.client, self.keys.controller_requests, self._last_request
        )
        for command in requested:
            error = _checked(command) or rollouts.handle(command)
            send_reply(self.client, self.keys, command.command_id, error)
        for command in sender.own_commands():
            error = rollouts.handle(command)
            if error:
                log.warning("rollout of '%s' not started: %s", command.model, error)
        rollouts.tick()
        autoscaler.tick()

    def on_lose(self, lease: Lease) -> None:
        self.leading = None
        self.stop()

    def stop(self) -> None:
        if self.poller is not None:
            self.poller.stop()
            self.poller = None


def _checked(command: ControlCommand) -> str | None:
    """Why a command from the rollout stream is refused, or None."""
    if command.op not in ROLLOUT_OPS:
        return f"'{command.op}' is not a rollout command"
    try:
        check_model_name(command.model)
    except SluiceError as exc:
        return exc.message
    return None


def controller_repository(
    settings: ControllerSettings,
) -> tuple[Path | None, RepositorySource | None]:
    """The controller's copy of the repository (for rollouts) and its source (for poll
    mode); None for both without ``model_repository``. A remote repository is copied now,
    before contending for the lease: a leader must not take longer than the lease to start."""
    if not settings.model_repository:
        return None, None
    source = open_source(settings.model_repository, settings)
    return snapshot_repository(settings.model_repository, settings), source


def run(
    settings: ControllerSettings, stop_event: threading.Event, *, announce: bool = True
) -> None:
    """A controller until ``stop_event`` is set (``sluice controller``, or a thread of
    ``sluice up``, which does not ``announce`` on stdout that it leads)."""
    repository, source = controller_repository(settings)
    executor = start_executor(settings, repository, stop_event)
    client = connect(
        settings.redis_url,
        socket_timeout=settings.lease_renew_s,
        socket_connect_timeout=settings.lease_renew_s,
    )
    decisions = Decisions(
        client,
        Keys(settings.namespace),
        repository,
        source,
        settings.repository_poll_s,
        announce=announce,
    )
    try:
        run_controller(
            settings, stop_event, decisions.on_lead, decisions.tick, on_lose=decisions.on_lose
        )
    finally:
        decisions.stop()
        client.close()
        if executor is not None:
            executor.join(5)


def main() -> int:
    settings = ControllerSettings()
    configure_logging("controller", settings)
    stop_event = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop_event.set())
    try:
        run(settings, stop_event)
    except SourceError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
