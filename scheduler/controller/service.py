"""The controller: lead through the lease and decide, or stand by until the leader is gone.

Several controllers may run (``sluice up`` runs one beside its executor, ``sluice controller``
runs one alone); one leads (see :mod:`.leadership` and :mod:`.leading`) and ticks about every
second; the others wait and take over within the lease's lifetime of the leader's death. A leader
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
import threading
from collections.abc import Callable
from pathlib import Path

from redis import Redis

from sluice.core.control import REPLY_TTL_S, ControlCommand, read_commands, send_reply
from sluice.core.errors import SluiceError, StartupFailed
from sluice.core.keys import Keys
from sluice.core.redis_client.connect import connect
from sluice.core.rollout import OPS as ROLLOUT_OPS
from sluice.core.settings import ControllerSettings
from sluice.scheduler.controller.autoscaler import Autoscaler
from sluice.scheduler.controller.fenced_commands import CommandSender, served_models
from sluice.scheduler.controller.leadership import Lease, Write
from sluice.scheduler.controller.leading import run_controller
from sluice.scheduler.controller.repository_poller import RepositoryPoller
from sluice.scheduler.controller.rollouts import RolloutManager
from sluice.scheduler.repository.local import LocalSource
from sluice.scheduler.repository.locations import open_source, snapshot_repository
from sluice.scheduler.repository.sources import RepositorySource, SourceError
from sluice.scheduler.repository.staging import check_model_name

log = logging.getLogger("sluice.scheduler.controller")

ExecutorStarter = Callable[
    [ControllerSettings, Path | None, threading.Event], threading.Thread | None
]
"""Starts an executor beside the controller (Kubernetes), or returns None."""


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
        """Take up what the previous leader left (see :meth:`tick`, which calls this again
        while it has not succeeded: a leader that failed to start must not hold the lease
        while deciding nothing)."""
        sender = CommandSender(self.client, self.keys, lease)
        sender.loaded = served_models(self.client, self.keys, self.repository)
        local = isinstance(self.source, LocalSource)
        rollouts = RolloutManager(self.client, self.keys, sender, local_copy=local)
        rollouts.recover()
        # What waits was sent to the previous leader too (what it handled, it removed), but
        # not what is older than a reply lives: its sender gave up on it long ago.
        seconds, _ = self.client.time()
        self._last_request = f"{max(0, int(seconds) - REPLY_TTL_S) * 1000}-0"
        self.leading = (sender, rollouts, Autoscaler(self.client, self.keys, sender))
        if self.announce:
            print(f"Controller {lease.holder} leads (fencing token {lease.token})", flush=True)

    def tick(self, lease: Lease) -> None:
        if self.leading is None:
            self.on_lead(lease)
            return
        sender, rollouts, autoscaler = self.leading
        sender.loaded = served_models(self.client, self.keys, self.repository)
        # The executors set the mode; they may start after the controller.
        polled = self.source is not None and self.poller is None
        if polled and self.client.get(self.keys.control_mode) == b"poll":
            assert self.source is not None
            self.poller = RepositoryPoller(self.source, sender, self.poll_s, self.client, self.keys)
            self.poller.start()
        read_before = self._last_request
        self._last_request, requested = read_commands(
            self.client, self.keys.controller_requests, read_before
        )
        for command in requested:
            error = _checked(command) or _handled(rollouts, command)
            send_reply(self.client, self.keys, command.command_id, error)
        if self._last_request != read_before:  # handled: no later leadership does it again
            stream = self.keys.controller_requests
            lease.apply([Write("XTRIM", stream, ("MINID", _next_id(self._last_request)))])
        for command in sender.own_commands():
            error = _handled(rollouts, command)
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


def _next_id(entry_id: str) -> str:
    """The stream entry id right after ``entry_id`` (``XTRIM MINID`` keeps its own)."""
    milliseconds, _, sequence = entry_id.partition("-")
    return f"{milliseconds}-{int(sequence or 0) + 1}"


def _handled(rollouts: RolloutManager, command: ControlCommand) -> str | None:
    """Carry out a rollout command; the error text, or None. A failure the manager did not
    foresee is logged and answered as one: the commands after it are carried out all the
    same."""
    try:
        return rollouts.handle(command)
    except Exception:
        log.exception("the %s of '%s' failed", command.op, command.model)
        return f"the controller failed to carry out the {command.op}; see its log"


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
    try:
        source = open_source(settings.model_repository, settings)
        return snapshot_repository(settings.model_repository, settings), source
    except SourceError as exc:
        raise StartupFailed(exc.message) from None


def run(
    settings: ControllerSettings,
    stop_event: threading.Event,
    *,
    announce: bool = True,
    start_executor: ExecutorStarter | None = None,
) -> None:
    """A controller until ``stop_event`` is set (``sluice controller``, or a thread of
    ``sluice up``, which does not ``announce`` on stdout that it leads)."""
    repository, source = controller_repository(settings)
    executor = start_executor(settings, repository, stop_event) if start_executor else None
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
