"""The controller's autoscaling: every second, reads each autoscaled model version's queue
from Redis and decides how many instances it should have (:mod:`.autoscaling`).

A decision is a fenced write of the wanted count to ``Keys.desired_instances``; executors
(:mod:`..executor.instances`) start or retire worker processes to match. A retired worker gets
SIGTERM and answers what it holds before it exits; what waits in the stream is taken by the
others, so scaling down loses no request. On a cluster a platform applies the same counts
(see the scale-out issue).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, cast

from redis import Redis
from redis.exceptions import RedisError

from sluice.core.errors import InvalidConfig
from sluice.core.keys import WORKER_GROUP, Keys
from sluice.core.observability import statistics as st
from sluice.core.placement import placements, visible_gpus
from sluice.core.queue_streams import base_streams, with_tenants
from sluice.core.repository import RepositoryModel
from sluice.scheduler.controller.autoscaling import ScalePolicy, Scaler, Signals
from sluice.scheduler.controller.fenced_commands import CommandSender
from sluice.scheduler.controller.leadership import Write

log = logging.getLogger("sluice.scheduler.controller")


def instance_field(model: str, version: int) -> str:
    """The field of ``Keys.desired_instances`` for one model version."""
    return f"{model}:{version}"


def configured_instances(model: RepositoryModel) -> int:
    """Worker processes per version that the model's instance groups ask for."""
    assert model.config is not None
    return len(placements(model.config.instance_groups, visible_gpus()))


@dataclass
class Autoscaler:
    client: Redis
    keys: Keys
    sender: CommandSender
    interval_s: float = 1.0
    _due: float = 0.0
    _scalers: dict[tuple[str, int], Scaler] = field(default_factory=dict)
    _policies: dict[tuple[str, Any], ScalePolicy | None] = field(default_factory=dict)
    _answered: dict[tuple[str, int], deque[tuple[float, int]]] = field(default_factory=dict)
    _cold_since: dict[tuple[str, int], float] = field(default_factory=dict)
    _tenant_streams: dict[tuple[str, int], list[str]] = field(default_factory=dict)

    def tick(self) -> None:
        now = time.monotonic()
        if now < self._due:
            return
        self._due = now + self.interval_s
        desired = {
            k.decode(): int(v)
            for k, v in cast(
                dict[bytes, bytes], self.client.hgetall(self.keys.desired_instances)
            ).items()
            if v.isdigit()
        }
        wanted_fields: set[str] = set()
        models = [model for model, _ in list(self.sender.loaded.values())]
        self._forget(models)
        for model in models:
            policy = self._policy(model)
            if policy is None:
                continue
            for version in model.versions:
                name = instance_field(model.name, version)
                wanted_fields.add(name)
                current = desired.get(name, configured_instances(model))
                try:
                    self._scale(model, version, policy, current, now)
                except RedisError as exc:
                    log.warning("autoscaling '%s': Redis: %s", model.name, exc)
                    return
        stale = tuple(set(desired) - wanted_fields)
        if stale:  # unloaded, or no longer autoscaled: instances as configured
            write = Write("HDEL", self.keys.desired_instances, stale)
            self.sender.apply([write], {"op": "scale_reset", "models": list(stale)})

    def _forget(self, models: list[RepositoryModel]) -> None:
        """Drop what is kept for model versions no longer served (and configurations no
        longer in force): a repository whose versions come and go for months must not grow
        the controller."""
        served = {(model.name, version) for model in models for version in model.versions}
        configs = {(model.name, model.config) for model in models}
        for table in (self._scalers, self._answered, self._cold_since, self._tenant_streams):
            for key in [key for key in table if key not in served]:
                del table[key]
        self._policies = {k: p for k, p in self._policies.items() if k in configs}

    def _policy(self, model: RepositoryModel) -> ScalePolicy | None:
        key = (model.name, model.config)
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
        current: int,
        now: float,
    ) -> None:
        key = (model.name, version)
        scaler = self._scalers.setdefault(key, Scaler(policy))
        scaler.policy = policy
        signals = self._signals(model, version, now)
        target = scaler.target(current, signals, now)
        if signals.backlog and not current:
            self._cold_since.setdefault(key, now)
        elif current and key in self._cold_since and signals.answered_per_s > 0:
            cold_s = now - self._cold_since.pop(key)
            log.info("'%s' version %d served again %.1f s after a cold start", *key, cold_s)
            self.client.hset(self.keys.stats(*key), "cold_start.ms", int(cold_s * 1000))
        if target == current:
            return
        direction = "up" if target > current else "down"
        write = Write("HSET", self.keys.desired_instances, (instance_field(*key), target))
        decision = {
            "op": f"scale_{direction}",
            "model": model.name,
            "version": version,
            "from": current,
            "to": target,
            "backlog": signals.backlog,
            "oldest_s": round(signals.oldest_age_s, 3),
        }
        if self.sender.apply([write], decision):
            log.info(
                "scaling '%s' version %d %s: %d -> %d instances (backlog %d, oldest %.2f s)",
                model.name,
                version,
                direction,
                current,
                target,
                signals.backlog,
                signals.oldest_age_s,
            )

    def _signals(self, model: RepositoryModel, version: int, now: float) -> Signals:
        assert model.config is not None
        dynamic = model.config.dynamic_batching
        bases = base_streams(
            self.keys, model.name, version, dynamic.priority_levels if dynamic else 0
        )
        # The tenant streams read with the last look (a new one counts from the next).
        streams = with_tenants(bases, self._tenant_streams.get((model.name, version), ()))
        # Redis's clock (entry ids are its milliseconds), asked apart: a cluster's pipelines
        # cannot carry TIME.
        seconds, microseconds = self.client.time()
        with self.client.pipeline(transaction=False) as pipe:
            pipe.hmget(
                self.keys.stats(model.name, version),
                [st.count_field("success"), st.count_field("fail")],
            )
            for stream in streams:
                pipe.xlen(stream)
                pipe.xpending(stream, WORKER_GROUP)
                pipe.xrange(stream, "-", "+", count=1)
            pipe.smembers(self.keys.tenant_streams(model.name, version))
            results = pipe.execute(raise_on_error=False)
        if isinstance(results[-1], set):
            self._tenant_streams[(model.name, version)] = sorted(
                m.decode() if isinstance(m, bytes) else str(m) for m in results[-1]
            )
        now_ms = int(seconds) * 1000 + int(microseconds) // 1000
        answered = sum(int(v) for v in results[0] if v is not None)
        backlog = busy = 0
        oldest_ms: int | None = None
        for index in range(len(streams)):
            length, pending, first = results[1 + 3 * index : 4 + 3 * index]
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
