"""Applies :mod:`scheduler.autoscaling`'s decisions on one machine: every second, reads each
autoscaled model version's queue from Redis and starts or retires its worker processes.

A retired worker gets SIGTERM and answers what it holds before it exits; what waits in the
stream is taken by the others, so scaling down loses no request. Scaling on a cluster is a
platform's job (see the scale-out issue): this executor is the single-machine one.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

from redis import Redis
from redis.exceptions import RedisError

from scheduler.autoscaling import ScalePolicy, Scaler, Signals
from scheduler.supervisor import Child, ChildSpec, Supervisor
from sluice import statistics as st
from sluice.errors import InvalidConfig
from sluice.keys import WORKER_GROUP, Keys
from sluice.repository import RepositoryModel

log = logging.getLogger("sluice.up")

Fleet = dict[str, tuple[RepositoryModel, list[Child]]]
"""Model name -> (the model served, its worker processes), shared with model control."""
InstanceSpec = Callable[[RepositoryModel, int], ChildSpec]
"""The spec of one more worker of a model version."""


@dataclass
class Autoscaler:
    client: Redis
    keys: Keys
    supervisor: Supervisor
    fleet: Fleet
    instance_spec: InstanceSpec
    interval_s: float = 1.0
    _due: float = 0.0
    _scalers: dict[tuple[str, int], Scaler] = field(default_factory=dict)
    _policies: dict[int, ScalePolicy | None] = field(default_factory=dict)
    _answered: dict[tuple[str, int], deque[tuple[float, int]]] = field(default_factory=dict)
    _cold_since: dict[tuple[str, int], float] = field(default_factory=dict)

    def tick(self) -> None:
        now = time.monotonic()
        if now < self._due:
            return
        self._due = now + self.interval_s
        for name, (model, children) in list(self.fleet.items()):
            policy = self._policy(model)
            if policy is None:
                continue
            for version in model.versions:
                try:
                    self._scale(model, version, policy, children, now)
                except RedisError as exc:
                    log.warning("autoscaling '%s': Redis: %s", name, exc)
                    return

    def _policy(self, model: RepositoryModel) -> ScalePolicy | None:
        key = id(model)
        if key not in self._policies:
            try:
                self._policies[key] = (
                    ScalePolicy.from_config(model.config) if model.config is not None else None
                )
            except InvalidConfig as exc:
                log.error("not autoscaling: %s", exc.message)
                self._policies[key] = None
        return self._policies[key]

    def _scale(
        self,
        model: RepositoryModel,
        version: int,
        policy: ScalePolicy,
        children: list[Child],
        now: float,
    ) -> None:
        key = (model.name, version)
        scaler = self._scalers.setdefault(key, Scaler(policy))
        scaler.policy = policy
        running = [c for c in children if c.spec.version == version and not c.retiring]
        signals = self._signals(model, version, now)
        target = scaler.target(len(running), signals, now)
        if signals.backlog and not running:
            self._cold_since.setdefault(key, now)
        elif running and key in self._cold_since and signals.answered_per_s > 0:
            cold_s = now - self._cold_since.pop(key)
            log.info("'%s' version %d served again %.1f s after a cold start", *key, cold_s)
            self.client.hset(self.keys.stats(*key), "cold_start.ms", int(cold_s * 1000))
        if target > len(running):
            added = self.supervisor.add(
                [self.instance_spec(model, version) for _ in range(target - len(running))]
            )
            children.extend(added)
            log.info(
                "scaling '%s' version %d up: %d -> %d instances (backlog %d, oldest %.2f s)",
                model.name,
                version,
                len(running),
                target,
                signals.backlog,
                signals.oldest_age_s,
            )
        elif target < len(running):
            leaving = running[target:]
            self.supervisor.retire(leaving)
            for child in leaving:
                children.remove(child)
            log.info(
                "scaling '%s' version %d down: %d -> %d instances",
                model.name,
                version,
                len(running),
                target,
            )

    def _signals(self, model: RepositoryModel, version: int, now: float) -> Signals:
        assert model.config is not None
        dynamic = model.config.dynamic_batching
        streams = self.keys.request_streams(
            model.name, version, dynamic.priority_levels if dynamic else 0
        )
        with self.client.pipeline(transaction=False) as pipe:
            pipe.time()
            pipe.hmget(
                self.keys.stats(model.name, version),
                [st.count_field("success"), st.count_field("fail")],
            )
            for stream in streams:
                pipe.xlen(stream)
                pipe.xpending(stream, WORKER_GROUP)
                pipe.xrange(stream, "-", "+", count=1)
            results = cast(list[Any], pipe.execute(raise_on_error=False))
        seconds, microseconds = results[0]
        now_ms = int(seconds) * 1000 + int(microseconds) // 1000
        answered = sum(int(v) for v in results[1] if v is not None)
        backlog = busy = 0
        oldest_ms: int | None = None
        for index in range(len(streams)):
            length, pending, first = results[2 + 3 * index : 5 + 3 * index]
            backlog += length if isinstance(length, int) else 0
            busy += int(pending.get("pending", 0)) if isinstance(pending, dict) else 0
            if isinstance(first, list) and first:
                entry_ms = int(first[0][0].decode().split("-", 1)[0])
                oldest_ms = entry_ms if oldest_ms is None else min(oldest_ms, entry_ms)
        history = self._answered.setdefault((model.name, version), deque(maxlen=6))
        history.append((now, answered))
        first_t, first_count = history[0]
        rate = (answered - first_count) / (now - first_t) if now > first_t else 0.0
        age_s = max(0.0, (now_ms - oldest_ms) / 1000) if oldest_ms is not None else 0.0
        return Signals(backlog, busy, age_s, max(0.0, rate))
