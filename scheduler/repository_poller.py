"""Triton's ``--model-control-mode poll``: the repository is listed again every
``SLUICE_REPOSITORY_POLL_S`` seconds, and each model with a version that appeared, changed
or disappeared is loaded again (or unloaded when none is left) through model control, so a
reload serves throughout and a failed one leaves the serving model untouched.

Listing and copying a remote repository take time, so they run on a thread of their own;
the main loop only carries out the loads and unloads it is handed. A version still being
uploaded is not taken (see :mod:`scheduler.sources`).
"""

from __future__ import annotations

import logging
import threading

from scheduler.model_control import ModelControl
from scheduler.sources import RepositorySource, SourceError, poll
from sluice.control import ControlCommand

log = logging.getLogger("sluice.up")


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
            model = listed.models.get(name)
            op = "load" if model is not None and model.versions else "unload"
            log.info("model repository changed: %s '%s'", op, name)
            self.control.submit(ControlCommand(op, name))
