"""Triton's ``--model-control-mode poll``: the repository is listed again every
``SLUICE_REPOSITORY_POLL_S`` seconds, and each model with a version that appeared, changed
or disappeared is loaded again (or unloaded when none is left) through model control, so a
reload serves throughout and a failed one leaves the serving model untouched. A model whose
configuration asks for canaries (``sluice.rollout: canary``) gets a rollout of a new version
instead (:mod:`scheduler.rollouts`).

Listing and copying a remote repository take time, so they run on a thread of their own;
the main loop only carries out the loads and unloads it is handed. A version still being
uploaded is not taken (see :mod:`scheduler.sources`).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from typing import Any

from scheduler.model_control import ModelControl
from scheduler.sources import Changes, RepositorySource, SourceError, poll
from sluice.control import ControlCommand
from sluice.rollout import START

log = logging.getLogger("sluice.up")

ROLLOUT_KEY = "sluice.rollout"
"""A model config parameter: ``canary`` rolls each new version out (see scheduler.rollouts)
instead of switching to it at once."""
_PLAN_PARAMETERS: tuple[tuple[str, str, Callable[[str], Any]], ...] = (
    ("sluice.rollout_steps", "steps", lambda v: [int(s) for s in v.split(",")]),
    ("sluice.rollout_step_s", "step_s", float),
    ("sluice.rollout_min_samples", "min_samples", int),
)


class RepositoryPoller:
    def __init__(self, source: RepositorySource, control: ModelControl, interval_s: float) -> None:
        self.source, self.control, self.interval_s = source, control, interval_s
        self.served = source.served()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="repository-poll", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.poll_once()
            except SourceError as exc:
                log.warning("polling the model repository: %s", exc)
            except Exception:
                log.exception("polling the model repository failed")

    def poll_once(self) -> None:
        listed, changes = poll(self.source, self.served)
        if not changes:
            return
        result = self.source.materialise(listed)
        for name, reason in result.problems.items():
            log.warning("model '%s' not taken from %s: %s", name, self.source.location, reason)
        self.served = listed
        touched = {name for name, _ in (*changes.appeared, *changes.changed, *changes.disappeared)}
        for name in sorted(touched - set(result.problems)):
            rollout = self._rollout(name, changes)
            if rollout is not None:
                log.info("model repository changed: a rollout of '%s'", name)
                self.control.submit(ControlCommand(START, name, json.dumps(rollout)))
                continue
            model = listed.models.get(name)
            op = "load" if model is not None and model.versions else "unload"
            log.info("model repository changed: %s '%s'", op, name)
            self.control.submit(ControlCommand(op, name))

    def _rollout(self, name: str, changes: Changes) -> dict[str, Any] | None:
        """The rollout request for a new version of a model that asks for canaries
        (``sluice.rollout: canary`` in its config parameters), when that is all that changed:
        one version newer than the one it serves appeared."""
        loaded = self.control.loaded.get(name)
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
                try:
                    request[field] = parse(parameters[key])
                except ValueError:
                    log.error("model '%s': %s is not valid: %r", name, key, parameters[key])
        return request
