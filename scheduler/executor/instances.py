"""The executor's side of autoscaling: worker processes follow the controller's counts.

Every half second ``sluice up`` reads ``Keys.desired_instances`` and, for each model version
it serves that has a wanted count, starts workers or retires some (SIGTERM: a worker answers
what it holds before it exits; one still running ``SLUICE_WORKER_STOP_GRACE_S`` later is
killed, :mod:`.leaving`). A version with no count keeps the workers its configuration
asks for. New workers get the cores divided among all the workers running then, so a model
that scales up does not oversubscribe the machine.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

from redis import Redis

from sluice.core.keys import Keys
from sluice.core.placement import threads_per_instance
from sluice.core.repository import RepositoryModel
from sluice.scheduler.executor.supervisor import Child, ChildSpec, Supervisor

log = logging.getLogger("sluice.up")

Fleet = dict[str, tuple[RepositoryModel, list[Child]]]
"""Model name -> (the model served, its worker processes), shared with model control."""
InstanceSpec = Callable[[RepositoryModel, int, int], ChildSpec]
"""The spec of one more worker of a model version, with its compute threads."""


@dataclass
class InstanceReconciler:
    client: Redis
    keys: Keys
    supervisor: Supervisor
    fleet: Fleet
    instance_spec: InstanceSpec
    interval_s: float = 0.5
    _due: float = 0.0

    def tick(self) -> None:
        """Start or retire workers to match the wanted counts; Redis errors propagate."""
        now = time.monotonic()
        if now < self._due:
            return
        self._due = now + self.interval_s
        raw = cast(dict[bytes, bytes], self.client.hgetall(self.keys.desired_instances))
        if not raw:
            return
        wanted = {k.decode(): int(v) for k, v in raw.items() if v.isdigit()}
        for name, (model, children) in list(self.fleet.items()):
            for version in model.versions:
                count = wanted.get(f"{name}:{version}")
                if count is not None:
                    self._match(model, version, children, count)

    def _match(
        self, model: RepositoryModel, version: int, children: list[Child], count: int
    ) -> None:
        running = [c for c in children if c.spec.version == version and not c.retiring]
        if count > len(running):
            threads = threads_per_instance(count)
            specs = [
                self.instance_spec(model, version, threads) for _ in range(count - len(running))
            ]
            children.extend(self.supervisor.add(specs))
            log.info(
                "'%s' version %d: %d -> %d instances (%d compute thread(s) each new one)",
                model.name,
                version,
                len(running),
                count,
                threads,
            )
        elif count < len(running):
            leaving = running[count:]
            self.supervisor.retire(leaving)
            for child in leaving:
                children.remove(child)
            log.info(
                "'%s' version %d: %d -> %d instances", model.name, version, len(running), count
            )
