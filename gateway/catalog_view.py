"""The gateway's view of the control plane: models, versions and readiness.

Refreshed from Redis in the background (see :mod:`sluice.keys`), so that the
request path only reads local dictionaries.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast

from redis.asyncio import Redis

from sluice.catalog import CatalogEntry, decode_entry
from sluice.errors import NotFound, Unavailable
from sluice.keys import Keys, load_error_field
from sluice.wire import MalformedEntry

log = logging.getLogger(__name__)


@dataclass
class CatalogView:
    keys: Keys
    models: dict[str, CatalogEntry] = field(default_factory=dict)
    ready: dict[str, frozenset[int]] = field(default_factory=dict)
    load_errors: dict[str, str] = field(default_factory=dict)
    depths: dict[tuple[str, int], int] = field(default_factory=dict)
    """Entries in each model version's streams: its queue depth."""
    revision: bytes | None = None
    loaded: bool = False

    async def refresh(self, redis: Redis) -> None:
        revision = cast(bytes | None, await redis.get(self.keys.catalog_revision))
        # No revision after one was seen: Redis restarted and the controller has not
        # republished yet. Keep serving the catalog we know rather than answer 404s.
        lost = revision is None and self.revision is not None
        if not lost and (revision != self.revision or not self.loaded):
            raw = cast(dict[bytes, bytes], await redis.hgetall(self.keys.catalog))
            models: dict[str, CatalogEntry] = {}
            for field_name, value in raw.items():
                try:
                    entry = decode_entry(value)
                except MalformedEntry as exc:
                    log.error("ignoring catalog entry %r: %s", field_name, exc)
                    continue
                models[entry.name] = entry
            self.models, self.revision, self.loaded = models, revision, True
        now = time.time()
        async with redis.pipeline(transaction=False) as pipe:
            pipe.hgetall(self.keys.load_errors)
            order: list[tuple[str, int, int]] = []
            for entry in self.models.values():
                streams = self._streams(entry)
                for version in entry.versions:
                    pipe.zcount(self.keys.live_workers(entry.name, version), now, "+inf")
                    names = streams(version)
                    for stream in names:
                        pipe.xlen(stream)
                    order.append((entry.name, version, len(names)))
            results = await pipe.execute()
        self.load_errors = {k.decode(): v.decode() for k, v in results[0].items()}
        ready: dict[str, set[int]] = {}
        depths: dict[tuple[str, int], int] = {}
        position = 1
        for name, version, stream_count in order:
            if results[position]:
                ready.setdefault(name, set()).add(version)
            depths[(name, version)] = sum(results[position + 1 : position + 1 + stream_count])
            position += 1 + stream_count
        self.ready = {name: frozenset(versions) for name, versions in ready.items()}
        self.depths = depths

    def _streams(self, entry: CatalogEntry) -> Callable[[int], list[str]]:
        levels = 0
        if entry.config is not None and entry.config.dynamic_batching is not None:
            levels = entry.config.dynamic_batching.priority_levels
        return lambda version: self.keys.request_streams(entry.name, version, levels)

    def entry(self, model: str) -> CatalogEntry:
        entry = self.models.get(model)
        if entry is None:
            raise NotFound(f"unknown model: '{model}'")
        return entry

    def load_error(self, model: str, version: int) -> str | None:
        return self.load_errors.get(load_error_field(model, version))

    def is_ready(self, model: str, version: int) -> bool:
        return version in self.ready.get(model, ())

    def resolve(self, model: str, version: str | None) -> tuple[CatalogEntry, int]:
        """The entry and version a request addresses; raises NotFound or Unavailable."""
        entry = self.entry(model)
        if not entry.available:
            raise Unavailable(f"model '{model}' is unavailable: {entry.error}")
        if version is not None:
            number = _parse_version(version)
            if number not in entry.versions:
                raise NotFound(f"unknown version {version} of model '{model}'")
        else:
            ready = self.ready.get(model, frozenset())
            candidates = [v for v in entry.versions if v in ready] or [
                v for v in entry.versions if self.load_error(model, v) is None
            ]
            number = candidates[-1] if candidates else entry.versions[-1]
        error = self.load_error(model, number)
        if error is not None:
            raise Unavailable(f"model '{model}' version {number} is unavailable: {error}")
        return entry, number

    def not_ready(self) -> list[str]:
        """What keeps the server from Triton's strict readiness: each model version that is
        not ready (unavailable, or no live worker yet), as ``'name'`` or ``'name' version N``."""
        waiting: list[str] = []
        for name in sorted(self.models):
            entry = self.models[name]
            if not entry.available:
                waiting.append(f"'{name}' (unavailable)")
                continue
            for version in entry.versions:
                if not self.is_ready(name, version):
                    state = "unavailable" if self.load_error(name, version) else "loading"
                    waiting.append(f"'{name}' version {version} ({state})")
        return waiting


def _parse_version(version: str) -> int:
    if not (version.isascii() and version.isdigit()) or (
        len(version) > 1 and version.startswith("0")
    ):
        raise NotFound(f"unknown version '{version}'")
    return int(version)
