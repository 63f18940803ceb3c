"""Triton's ``--model-control-mode poll``, decided by the leading controller: the
repository is listed again every ``SLUICE_REPOSITORY_POLL_S`` seconds, and each model with a
version that appeared, changed or disappeared is loaded again (or unloaded when none is
left) by the executors, so a reload serves throughout and a failed one leaves the serving
model untouched. A model whose configuration asks for canaries (``sluice.rollout: canary``)
gets a rollout of a new version instead (:mod:`sluice.scheduler.controller.rollouts`).

What the controller acted upon is recorded in Redis (``Keys.polled_repository``, fenced):
a standby that takes over compares the repository with that record, so a change that landed
while the leader changed is acted upon once. The first controller ever takes the repository
as it is (the executors just read it).

Listing and copying a remote repository take time, so they run on a thread of their own.
A version still being uploaded is not taken (see :mod:`sluice.scheduler.repository.sources`),
and a model whose copy failed keeps what it served and is tried again at the next poll.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Container, Iterable
from typing import Any, cast

import orjson
from redis import Redis
from redis.exceptions import RedisError

from sluice.core.control import ControlCommand
from sluice.core.errors import InvalidInput
from sluice.core.keys import Keys
from sluice.core.rollout import START, RolloutPlan
from sluice.scheduler.controller.fenced_commands import CommandSender
from sluice.scheduler.controller.leadership import Write
from sluice.scheduler.repository.sources import (
    Changes,
    Listing,
    Model,
    RepositorySource,
    SourceError,
    Version,
    carry_over,
    diff,
)

log = logging.getLogger("sluice.up")

ROLLOUT_KEY = "sluice.rollout"
"""A model config parameter: ``canary`` rolls each new version out (see scheduler.rollouts)
instead of switching to it at once."""
_PLAN_PARAMETERS: tuple[tuple[str, str, Callable[[str], Any]], ...] = (
    ("sluice.rollout_steps", "steps", lambda v: [int(s) for s in v.split(",")]),
    ("sluice.rollout_step_s", "step_s", float),
    ("sluice.rollout_min_samples", "min_samples", int),
    ("sluice.rollout_shadow_s", "shadow_s", float),
    ("sluice.rollout_min_p99_increase_s", "min_p99_increase_s", float),
)


MAX_MODELS_PER_POLL = 100
"""Models acted upon per poll: the executors' control stream keeps about
:data:`~sluice.scheduler.controller.fenced_commands.COMMANDS_KEPT` commands, so where
thousands of models changed at once, the oldest commands would be dropped unread."""


class RepositoryPoller:
    def __init__(
        self,
        source: RepositorySource,
        sender: CommandSender,
        interval_s: float,
        client: Redis,
        keys: Keys,
    ) -> None:
        self.source, self.sender, self.interval_s = source, sender, interval_s
        self.client, self.keys = client, keys
        self.acted: Listing | None = None
        """The listing the loads and unloads decided so far correspond to."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="repository-poll", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll_once()
            except (SourceError, RedisError) as exc:
                log.warning("polling the model repository: %s", getattr(exc, "message", exc))
            except Exception:
                log.exception("polling the model repository failed")
            self._stop.wait(self.interval_s)

    def poll_once(self) -> None:
        listed = carry_over(self.source.served(), self.source.list())
        if self.acted is None:
            self.acted = self._recorded()
            if self.acted is None:  # the first controller: the executors just read it
                self.acted = listed
                self._record(listed, Changes())
        changes = diff(self.acted, listed)
        if not changes:
            return
        result = self.source.materialise(listed)
        for name, reason in result.problems.items():
            log.warning("model '%s' not taken from %s: %s", name, self.source.location, reason)
        touched = {name for name, _ in (*changes.appeared, *changes.changed, *changes.disappeared)}
        # A model not taken this time is left for the next poll (its change is seen again),
        # and so are those beyond this poll's share.
        taken = sorted(touched - set(result.problems))[:MAX_MODELS_PER_POLL]
        for name in taken:
            rollout = self._rollout(name, changes)
            if rollout is not None:
                log.info("model repository changed: a rollout of '%s'", name)
                self.sender.submit(ControlCommand(START, name, json.dumps(rollout)))
                continue
            model = listed.models.get(name)
            op = "load" if model is not None and model.versions else "unload"
            log.info("model repository changed: %s '%s'", op, name)
            if not self.sender.submit(ControlCommand(op, name)):
                return  # no longer leading: the next leader sees the change itself
        self.acted = _with_models(self.acted, listed, taken)
        self._record(self.acted, _of_models(changes, set(taken)))

    def _recorded(self) -> Listing | None:
        raw = self.client.get(self.keys.polled_repository)
        if raw is None:
            return None
        try:
            tokens = orjson.loads(cast(bytes, raw))
            models = {
                str(name): Model(
                    versions={int(v): Version((), str(t)) for v, t in versions.items()}
                )
                for name, versions in tokens.items()
            }
        except (ValueError, TypeError, AttributeError):
            log.error("the recorded repository listing is unreadable; taking the repository as is")
            return None
        return Listing(models)

    def _record(self, listed: Listing, changes: Changes) -> None:
        tokens = {
            name: {str(v): version.token for v, version in model.versions.items()}
            for name, model in listed.models.items()
        }
        decision = {
            "op": "repository_polled",
            "appeared": [f"{n}:{v}" for n, v in changes.appeared],
            "changed": [f"{n}:{v}" for n, v in changes.changed],
            "disappeared": [f"{n}:{v}" for n, v in changes.disappeared],
        }
        write = Write("SET", self.keys.polled_repository, (orjson.dumps(tokens),))
        self.sender.apply([write], decision)

    def _rollout(self, name: str, changes: Changes) -> dict[str, Any] | None:
        """The rollout request for a new version of a model that asks for canaries
        (``sluice.rollout: canary`` in its config parameters), when that is all that changed:
        one version newer than the one it serves appeared."""
        loaded = self.sender.loaded.get(name)
        if loaded is None or loaded[0].config is None or len(loaded[0].versions) != 1:
            return None
        parameters = loaded[0].config.parameters
        if parameters.get(ROLLOUT_KEY) != "canary":
            return None
        if any(n == name for n, _ in (*changes.changed, *changes.disappeared)):
            return None
        appeared = [v for n, v in changes.appeared if n == name]
        if len(appeared) != 1 or appeared[0] <= loaded[0].versions[0]:
            return None
        request: dict[str, Any] = {"version": appeared[0]}
        for key, field, parse in _PLAN_PARAMETERS:
            if key in parameters:
                # One that does not parse or fit is left out (its default applies): the new
                # version is still rolled out, not left unserved for a typo.
                try:
                    value = parse(parameters[key])
                    RolloutPlan.from_json({field: value})
                except (ValueError, InvalidInput):
                    log.error("model '%s': %s is not valid: %r", name, key, parameters[key])
                    continue
                request[field] = value
        return request


def _with_models(acted: Listing, listed: Listing, names: Iterable[str]) -> Listing:
    """``acted`` with the models ``names`` as ``listed`` holds them (none where it has none)."""
    models = dict(acted.models)
    for name in names:
        if name in listed.models:
            models[name] = listed.models[name]
        else:
            models.pop(name, None)
    return Listing(models)


def _of_models(changes: Changes, names: Container[str]) -> Changes:
    """The ``changes`` of the models ``names``."""
    return Changes(
        tuple(c for c in changes.appeared if c[0] in names),
        tuple(c for c in changes.changed if c[0] in names),
        tuple(c for c in changes.disappeared if c[0] in names),
    )
