"""Every request stream of a model version: its levels' base streams and its tenants' streams.

A model version's queue is one base stream per priority level and the background stream
(:meth:`sluice.core.keys.Keys.request_streams`, :meth:`~sluice.core.keys.Keys.background_stream`),
plus, for each tenant that sent it a request, that tenant's stream of the level
(:meth:`~sluice.core.keys.Keys.request_stream` with a tenant), listed in the version's set
:meth:`~sluice.core.keys.Keys.tenant_streams`. What reads the queue (workers, queue depth,
draining) takes the set's members with the base streams (:func:`with_tenants`), reading
the set in the round trip it already makes where it can (one refresh late for a new tenant).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from redis import Redis as SyncRedis
from redis.commands.core import AsyncScript
from redis.exceptions import RedisError

from sluice.core.keys import WORKER_GROUP, Keys, base_stream

WAKE_FIELD = b"wake"
"""The one field of a wake-up entry: a worker deletes it unread and reads the set again."""

REGISTER = """
-- KEYS: the tenant's stream, the version's set of tenant streams, the level's base stream
-- ARGV: the consumer group
redis.pcall('XGROUP', 'CREATE', KEYS[1], ARGV[1], '0', 'MKSTREAM')
if redis.call('SADD', KEYS[2], KEYS[1]) == 1 then
  redis.call('XADD', KEYS[3], '*', 'wake', '1')
  return 1
end
return 0
"""
"""Make a tenant's stream known before the first entry goes to it: its consumer group
(a BUSYGROUP error, the group exists, is ignored by ``pcall``), its place in the version's
set and, if it was new there, a wake-up entry in the level's base stream, which ends the
workers' blocking read so that they read the set again at once.
-> 1 the stream was new, 0 it was known."""


def register_keys(keys: Keys, model: str, version: int, stream: str) -> list[str]:
    """The keys of :data:`REGISTER` for ``stream`` (a tenant's stream)."""
    return [stream, keys.tenant_streams(model, version), base_stream(stream)]


def register_sync(client: SyncRedis, keys: Keys, model: str, version: int, stream: str) -> None:
    """Run :data:`REGISTER` for ``stream`` if it is a tenant's (a base stream needs nothing)."""
    if base_stream(stream) != stream:
        client.eval(REGISTER, 3, *register_keys(keys, model, version, stream), WORKER_GROUP)


FORGET_S = 30.0
"""How long a process trusts that a tenant stream it made known is still there."""


@dataclass
class TenantStreams:
    """What one gateway process made known (stream -> when to forget it, monotonic s)."""

    known: dict[str, float] = field(default_factory=dict)
    run_id: str = ""
    """The Redis server the cache is about (another one: forgotten)."""

    async def ensure(
        self,
        script: AsyncScript,
        keys: Keys,
        model: str,
        version: int,
        stream: str,
        run_id: str = "",
    ) -> None:
        """Make ``stream`` known before the first entry of this process goes to it (a base
        stream needs nothing). Raises RedisError like the append that follows would."""
        if base_stream(stream) == stream:
            return
        now = time.monotonic()
        if run_id != self.run_id:
            self.known.clear()
            self.run_id = run_id
        until = self.known.get(stream)
        if until is not None and until > now:
            return
        try:
            await script(keys=register_keys(keys, model, version, stream), args=[WORKER_GROUP])
        except RedisError:
            self.known.clear()
            raise
        if len(self.known) > 10_000:
            self.known = {s: t for s, t in self.known.items() if t > now}
        self.known[stream] = now + FORGET_S


Version = tuple[str, int]
"""A model version: (model, version)."""


def base_streams(keys: Keys, model: str, version: int, priority_levels: int) -> list[str]:
    """The base streams of a model version: its online levels, highest first, then the
    background stream (a stream's index is its level, as the workers count them)."""
    return [
        *keys.request_streams(model, version, priority_levels),
        keys.background_stream(model, version),
    ]


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def with_tenants(bases: list[str], members: Iterable[Any]) -> list[str]:
    """``bases`` and the tenant streams among ``members`` (the version's set) that belong to
    one of them, each after its level's base stream (tenants in name order)."""
    by_base: dict[str, list[str]] = {base: [] for base in bases}
    for member in members:
        stream = _text(member)
        tenants = by_base.get(base_stream(stream))
        if tenants is not None and stream not in by_base:
            tenants.append(stream)
    streams: list[str] = []
    for base, tenants in by_base.items():
        streams.append(base)
        streams += sorted(tenants)
    return streams


def levels_of(bases: list[str], streams: Iterable[str]) -> dict[str, int]:
    """Stream -> its level (the index of its base stream in ``bases``)."""
    index = {base: level for level, base in enumerate(bases)}
    return {stream: index[base_stream(stream)] for stream in streams}


def tenant_members_sync(
    client: SyncRedis, keys: Keys, versions: Iterable[Version]
) -> dict[Version, list[str]]:
    """The tenant streams of each of ``versions`` (one round trip)."""
    wanted = list(versions)
    if not wanted:
        return {}
    with client.pipeline(transaction=False) as pipe:
        for model, version in wanted:
            pipe.smembers(keys.tenant_streams(model, version))
        found = pipe.execute()
    return {v: sorted(_text(m) for m in members) for v, members in zip(wanted, found, strict=True)}
