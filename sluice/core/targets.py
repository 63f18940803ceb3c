"""Which stream a request for a model (and version) goes to, for callers other than the
gateway: an ensemble's worker calling its composing models, a Python model calling another
(BLS).

The same rules as the gateway's :class:`sluice.gateway.control.catalog_view.CatalogView` for
a request that names a version or none (Triton's): the catalog entry says which versions are
served, a version is ready while a worker of it beats (:meth:`sluice.core.keys.Keys.live_workers`),
no version named (``-1``) means the highest ready one, and the stream is the version's
default priority level (:meth:`sluice.core.keys.Keys.request_stream`). A model loaded on
demand takes requests whether or not it is loaded (no version named: the highest ready
one, else the highest), and the executors are woken for a version not loaded. What Redis
says is kept for as long as a gateway keeps its view, so a step costs no extra round trip.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import cast

from redis.asyncio import Redis

from sluice.core.catalog import CatalogEntry, decode_entry
from sluice.core.clock import CLOCK
from sluice.core.config import ModelConfig
from sluice.core.errors import NotFound, Unavailable
from sluice.core.keys import Keys
from sluice.core.on_demand import DemandWake
from sluice.core.wire import MalformedEntry

LATEST = -1
REFRESH_S = 0.5
"""How long a model's catalog entry and readiness are reused (the gateway's default
``SLUICE_CATALOG_REFRESH_S``)."""


@dataclass(frozen=True, slots=True)
class Target:
    model: str
    version: int
    stream: str
    config: ModelConfig
    revision: str = ""
    """The catalog's revision the entry was read at (it moves on every load and unload)."""


@dataclass(slots=True)
class _Known:
    entry: CatalogEntry | None
    ready: frozenset[int]
    read_at: float
    revision: str = ""


def default_level(config: ModelConfig) -> int:
    """The priority level of a request that asks for none (0: the model has no levels)."""
    dynamic = config.dynamic_batching
    if dynamic is None or not dynamic.priority_levels:
        return 0
    return dynamic.default_priority_level or dynamic.priority_levels


class TargetResolver:
    def __init__(self, redis: Redis, keys: Keys, refresh_s: float = REFRESH_S) -> None:
        self._redis = redis
        self._keys = keys
        self._refresh_s = refresh_s
        self._known: dict[str, _Known] = {}
        self._wake = DemandWake()

    async def resolve(self, model: str, version: int) -> Target:
        """The stream for ``model`` at ``version`` (-1: the highest ready version); raises
        :class:`NotFound` for a model the catalog does not list, :class:`Unavailable`
        naming the model when it cannot take requests now."""
        known = self._known.get(model)
        if known is None or time.monotonic() - known.read_at > self._refresh_s:
            known = self._remember(model, await self._read(model))
        entry = known.entry
        if entry is None:  # (Triton's text and status for a model it does not know)
            raise NotFound(f"Request for unknown model: '{model}' is not found")
        if not entry.available or entry.config is None:
            raise Unavailable(f"model '{model}' is unavailable: {entry.error}")
        if version == LATEST:
            ready = [v for v in entry.versions if v in known.ready]
            if not ready and not entry.on_demand:
                raise Unavailable(f"model '{model}' has no ready version (no live instance)")
            version = (ready or list(entry.versions))[-1]
        elif version not in entry.versions:
            raise Unavailable(f"model '{model}' version {version} is not served")
        elif version not in known.ready and not entry.on_demand:
            raise Unavailable(f"model '{model}' version {version} is not ready (no live instance)")
        if version not in known.ready:
            # On demand: the request waits in the queue while an executor loads the version
            # (or answers it with the reason it cannot), as a client's request does.
            await self._wake.wake(self._redis, self._keys, model, version)
        stream = self._keys.request_stream(model, version, default_level(entry.config))
        return Target(model, version, stream, entry.config, known.revision)

    def _remember(self, model: str, known: _Known) -> _Known:
        """Keep what was read of ``model`` for :data:`REFRESH_S`, unless the catalog does not
        list it: a model may call names its clients chose, and remembering every one would
        grow without bound (an unknown name costs one read each time, as at the gateway)."""
        if known.entry is None:
            self._known.pop(model, None)
        else:
            self._known[model] = known
        return known

    def forget(self, model: str) -> None:
        """Read ``model``'s entry afresh next time (it was just loaded or unloaded)."""
        self._known.pop(model, None)

    async def ready(self, model: str, version: int) -> bool:
        """Whether ``model`` (``version`` -1: any of its versions) is available with a live
        instance now, read afresh."""
        known = self._remember(model, await self._read(model))
        entry = known.entry
        if entry is None or not entry.available:
            return False
        if version == LATEST:
            return any(v in known.ready for v in entry.versions)
        return version in entry.versions and version in known.ready

    async def _read(self, model: str) -> _Known:
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hget(self._keys.catalog, model)
            pipe.get(self._keys.catalog_revision)  # (the catalog's slot: one transaction)
            raw, revision = cast(list[bytes | None], await pipe.execute())
        entry: CatalogEntry | None = None
        if raw is not None:
            try:
                entry = decode_entry(raw)
            except MalformedEntry:
                entry = None
        ready: set[int] = set()
        if entry is not None and entry.versions:
            now = CLOCK.now()
            async with self._redis.pipeline(transaction=False) as pipe:
                for version in entry.versions:
                    pipe.zcount(self._keys.live_workers(model, version), now, "+inf")
                counts = await pipe.execute()
            ready = {v for v, count in zip(entry.versions, counts, strict=True) if count}
        return _Known(entry, frozenset(ready), time.monotonic(), (revision or b"").decode())
