"""Models loaded on demand: which ones, and what the executors tell the gateways about them.

A model is on demand with ``sluice up --model-control-mode demand`` (every model of the
repository but the pinned ones) or with its own ``parameters { key: "sluice.load" value {
string_value: "on_demand" } }`` in the default mode. It is in the catalog from the start, so
gateways admit its requests; they wait in its stream while an executor starts its workers
(:mod:`sluice.scheduler.executor.on_demand`), and once it has none queued and others need
the memory, it may be unloaded again.

What the gateways read, written by each executor with an expiry (a host that died stops
counting within seconds):

- ``Keys.on_demand_states``: per host and model version, ``LOADING`` or ``READY``; a version
  no live host reports is ``UNLOADED_ON_DEMAND`` in the repository index;
- ``Keys.host_memory``: per host, the budget and the memory in use, by device;
- ``Keys.demand_requests``: the wake-up for the executors when a gateway, an ensemble's
  step or a BLS call queues a request for a version no worker serves, or a batch job's shard
  starts on an on-demand version (they would otherwise notice at their next tick):
  :class:`DemandWake`, :func:`wake_blocking`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson
from redis import Redis as SyncRedis
from redis.asyncio import Redis
from redis.exceptions import RedisError

from sluice.core.config import ModelConfig
from sluice.core.errors import InvalidConfig
from sluice.core.keys import Keys

LOAD_KEY = "sluice.load"
"""Model parameter: ``on_demand`` (loaded when a request comes) or ``always``."""
PINNED_KEY = "sluice.pinned"
"""Model parameter: ``true`` keeps the model loaded from the start, never evicted."""
LOAD_VALUES = ("on_demand", "always")

READY = "READY"
LOADING = "LOADING"
UNLOADED = "UNLOADED_ON_DEMAND"
"""The repository index's state of an on-demand version that no host has loaded."""

STATE_TTL_S = 10.0
"""How long a host's report counts without being renewed (it renews every second)."""

EVICTION_REASONS = ("budget", "refused")
"""``budget``: unloaded to make room for another model; ``refused``: measured larger than
the whole budget, or its load failed (its deadline passed included), unloaded for good."""


def eviction_field(reason: str) -> str:
    """The counter of a version's evictions for ``reason`` in its statistics hash."""
    return f"evictions.{reason}"


def _truthy(value: str) -> bool:
    return value.strip().lower() in ("true", "1", "yes", "on")


def is_pinned(config: ModelConfig) -> bool:
    return _truthy(config.parameters.get(PINNED_KEY, ""))


def is_on_demand(config: ModelConfig, mode: str) -> bool:
    """Whether the model is loaded on demand under model control ``mode``; InvalidConfig
    names the parameter when its value is not one this knows."""
    load = config.parameters.get(LOAD_KEY, "").strip().lower()
    if load and load not in LOAD_VALUES:
        raise InvalidConfig(
            f"model '{config.name}': parameter {LOAD_KEY} is '{load[:64]}'; it may be "
            + " or ".join(LOAD_VALUES)
        )
    if is_pinned(config) or load == "always":
        return False
    return mode == "demand" or (mode == "none" and load == "on_demand")


def state_field(host: str, model: str, version: int) -> str:
    """The field of ``Keys.on_demand_states`` for one host and version ("/" is in neither a
    host id nor a model name)."""
    return f"{host}/{model}/{version}"


def encode_state(model: str, version: int, state: str, until_s: float) -> bytes:
    return orjson.dumps({"model": model, "version": version, "state": state, "until": until_s})


def version_states(raw: Mapping[Any, Any], now_s: float) -> dict[tuple[str, int], str]:
    """Each on-demand version's state over every host whose report has not expired:
    ``READY`` where any host serves it, else ``LOADING`` where any loads it."""
    states: dict[tuple[str, int], str] = {}
    for value in raw.values():
        try:
            report = orjson.loads(value)
            key = (str(report["model"]), int(report["version"]))
            state, until = str(report["state"]), float(report["until"])
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
            continue
        if until >= now_s and states.get(key) != READY:
            states[key] = state
    return states


@dataclass(frozen=True, slots=True)
class HostMemory:
    """One host's memory budget and use, by device (``host``, ``gpu0`` ...)."""

    host: str
    budget: dict[str, int]
    used: dict[str, int]
    until: float

    def encode(self) -> bytes:
        return orjson.dumps({"budget": self.budget, "used": self.used, "until": self.until})


def host_memories(raw: Mapping[Any, Any], now_s: float) -> list[HostMemory]:
    """The reports of the hosts that have not expired, by host."""
    hosts: list[HostMemory] = []
    for host, value in sorted(raw.items()):
        try:
            report = orjson.loads(value)
            memory = HostMemory(
                host.decode() if isinstance(host, bytes) else str(host),
                {str(k): int(v) for k, v in report["budget"].items()},
                {str(k): int(v) for k, v in report["used"].items()},
                float(report["until"]),
            )
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError):
            continue
        if memory.until >= now_s:
            hosts.append(memory)
    return hosts


WAKE_EVERY_S = 0.25
"""At most one wake-up per model version and process this often: the first request starts
the load, the others wait for it in the queue."""
_DEMAND_STREAM_MAX_LEN = 1000


def wake_blocking(redis: SyncRedis, keys: Keys, model: str, version: int) -> None:
    """:meth:`DemandWake.wake` for a process without an event loop (a batch worker's shard,
    once per shard): best effort, as the executors find the queued work at their tick."""
    with contextlib.suppress(RedisError):
        redis.xadd(
            keys.demand_requests,
            {"model": model, "version": str(version)},
            maxlen=_DEMAND_STREAM_MAX_LEN,
            approximate=True,
        )


@dataclass
class DemandWake:
    """Wakes the executors (an entry on ``Keys.demand_requests``, which each executor's
    command watcher blocks on) when a request was queued for an on-demand version that no
    worker serves, so that its load starts at once rather than at their next tick."""

    _last: dict[tuple[str, int], float] = field(default_factory=dict)

    async def wake(self, redis: Redis, keys: Keys, model: str, version: int) -> None:
        now = time.monotonic()
        if now - self._last.get((model, version), -WAKE_EVERY_S) < WAKE_EVERY_S:
            return
        self._last[(model, version)] = now
        # (Without it, the request is queued all the same: the executors find it at their tick.)
        with contextlib.suppress(RedisError):
            await redis.xadd(
                keys.demand_requests,
                {"model": model, "version": str(version)},
                maxlen=_DEMAND_STREAM_MAX_LEN,
                approximate=True,
            )
