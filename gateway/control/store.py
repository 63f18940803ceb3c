"""The gateway's control-plane store: the catalog and model control, rollouts, version
labels and traffic splits, statistics and metrics, this process's report, and the
registered Lua scripts, behind methods named for what they do.

:class:`ControlPlane` is what route modules call; :class:`RedisControlPlane` is the one the
gateway runs (Redis, as every other service reads it). A test double can answer the same
methods from memory, so HTTP semantics tests of control routes need no Redis. The data
plane (request streams and replies) goes through :mod:`sluice.core.dispatch` instead.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Protocol, cast

from redis.asyncio import Redis
from redis.commands.core import AsyncScript
from redis.exceptions import WatchError

from sluice.core.clock import CLOCK
from sluice.core.control import live_executors_async
from sluice.core.errors import Unavailable
from sluice.core.keys import Keys
from sluice.core.redis_client.connect import server_identity
from sluice.core.routing import Routing, decode_routing, encode_routing
from sluice.gateway.control.catalog_view import CatalogView
from sluice.gateway.metrics import snapshot as metric_snapshot
from sluice.gateway.metrics.snapshot import Snapshot
from sluice.gateway.redis_room import RedisRoom

RawHash = dict[bytes, bytes]
"""A hash as the store answers it: field bytes -> value bytes."""

ROUTING_ATTEMPTS = 8
"""Optimistic transactions tried for one routing change before it is refused."""

_COMMAND_STREAM_MAX_LEN = 1000


class ControlPlane(Protocol):
    """What the gateway reads and writes outside the request path."""

    async def server_identity(self) -> str:
        """The store's run id (another one: it restarted and lost what it held)."""
        ...

    async def sync_clock(self) -> None:
        """Align :data:`sluice.core.clock.CLOCK` with the store's clock."""
        ...

    async def refresh_catalog(self, view: CatalogView) -> None:
        """The catalog, readiness and queue depths, into ``view``."""
        ...

    async def refresh_routing(self, view: CatalogView) -> None:
        """Every catalog model's labels and weights, into ``view.routing``."""
        ...

    async def refresh_room(self, room: RedisRoom) -> None:
        """The store's memory use, into ``room``."""
        ...

    async def explicit_model_control(self) -> bool:
        """Whether ``sluice up`` runs with explicit model control (load / unload allowed)."""
        ...

    async def send_command(self, stream: str, fields: Mapping[bytes, bytes]) -> str:
        """Hand an encoded control command to its executors' stream; its entry's id."""
        ...

    async def drop_command(self, stream: str, entry_id: str) -> None:
        """Remove a command every executor has answered (it may carry large files)."""
        ...

    async def take_reply(self, reply_key: str) -> bytes | None:
        """A command's next reply, if one has come (taken: read once)."""
        ...

    async def live_executors(self) -> frozenset[str]:
        """The executors alive now (each answers every load and unload)."""
        ...

    async def rollout(self, model: str) -> bytes | None:
        """The model's rollout state document (JSON), None when it has none."""
        ...

    async def routing(self, model: str) -> Routing:
        """The model's version labels and traffic split."""
        ...

    async def update_routing(self, model: str, change: Callable[[Routing], Routing]) -> Routing:
        """Read, change and write the model's routing in one optimistic transaction;
        Unavailable when it kept changing under us."""
        ...

    async def publish_report(
        self,
        gateway_id: str,
        gauges: Mapping[str, int],
        ttl_s: int,
        now: float,
        counts: Sequence[tuple[str, str, int]],
    ) -> None:
        """This process's gauges (expiring ``ttl_s`` after ``now``) and counters to add:
        (statistics hash, field, count)."""
        ...

    async def withdraw_report(self, gateway_id: str) -> None:
        """This process stops: it leaves the live processes (and its gauges go) at once,
        instead of when its report expires."""
        ...

    async def model_statistics(
        self, models: Sequence[tuple[str, int]]
    ) -> list[tuple[RawHash, RawHash, RawHash]]:
        """Per model version: its request, batch and instance statistics hashes."""
        ...

    async def metric_snapshot(self, view: CatalogView) -> Snapshot:
        """Everything one ``/metrics`` scrape renders."""
        ...

    async def live_workers(self, model: str, version: int, now: float) -> list[bytes | str]:
        """The workers of a model version whose liveness runs past ``now``."""
        ...

    def script(self, source: str) -> AsyncScript:
        """The Lua script, registered once: EVALSHA from then on."""
        ...


class RedisControlPlane:
    """The control plane in Redis."""

    def __init__(self, redis: Redis, keys: Keys) -> None:
        self.redis = redis
        self.keys = keys
        self._scripts: dict[str, AsyncScript] = {}

    async def server_identity(self) -> str:
        return await server_identity(self.redis)

    async def sync_clock(self) -> None:
        await CLOCK.sync(self.redis)

    async def refresh_catalog(self, view: CatalogView) -> None:
        await view.refresh(self.redis)

    async def refresh_routing(self, view: CatalogView) -> None:
        await view.routing.refresh(self.redis, self.keys, view.models)

    async def refresh_room(self, room: RedisRoom) -> None:
        await room.refresh(self.redis)

    async def explicit_model_control(self) -> bool:
        return bool(await self.redis.get(self.keys.control_mode) == b"explicit")

    async def send_command(self, stream: str, fields: Mapping[bytes, bytes]) -> str:
        entry_id = await self.redis.xadd(
            stream,
            fields,  # type: ignore[arg-type]
            maxlen=_COMMAND_STREAM_MAX_LEN,
            approximate=True,
        )
        return entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)

    async def drop_command(self, stream: str, entry_id: str) -> None:
        await self.redis.xdel(stream, entry_id)

    async def take_reply(self, reply_key: str) -> bytes | None:
        raw = await self.redis.lpop(reply_key)
        return raw if isinstance(raw, bytes) else None

    async def live_executors(self) -> frozenset[str]:
        return await live_executors_async(self.redis, self.keys)

    async def rollout(self, model: str) -> bytes | None:
        return cast(bytes | None, await self.redis.get(self.keys.rollout(model)))

    async def routing(self, model: str) -> Routing:
        raw = await self.redis.hgetall(self.keys.routing(model))
        return decode_routing(cast(RawHash, raw))

    async def update_routing(self, model: str, change: Callable[[Routing], Routing]) -> Routing:
        key = self.keys.routing(model)
        async with self.redis.pipeline(transaction=True) as pipe:
            for _ in range(ROUTING_ATTEMPTS):
                try:
                    await pipe.watch(key)
                    raw = cast(RawHash, await pipe.hgetall(key))
                    routing = change(decode_routing(raw))
                    pipe.multi()  # type: ignore[no-untyped-call]  # (untyped in redis-py)
                    pipe.delete(key)
                    fields = encode_routing(routing)
                    if fields:
                        pipe.hset(key, mapping=fields)  # type: ignore[arg-type]
                    await pipe.execute()
                except WatchError:
                    continue
                return routing
        raise Unavailable(f"the routing of model '{model}' kept changing; retry")

    async def publish_report(
        self,
        gateway_id: str,
        gauges: Mapping[str, int],
        ttl_s: int,
        now: float,
        counts: Sequence[tuple[str, str, int]],
    ) -> None:
        keys = self.keys
        async with self.redis.pipeline(transaction=False) as pipe:
            report_key = keys.gateway_report(gateway_id)
            pipe.hset(report_key, mapping=dict(gauges))  # type: ignore[arg-type]
            pipe.expire(report_key, ttl_s)
            pipe.zadd(keys.gateways, {gateway_id: now + ttl_s})
            pipe.zremrangebyscore(keys.gateways, "-inf", now)
            for key, field_name, count in counts:
                pipe.hincrby(key, field_name, count)
            await pipe.execute()

    async def withdraw_report(self, gateway_id: str) -> None:
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.zrem(self.keys.gateways, gateway_id)
            pipe.delete(self.keys.gateway_report(gateway_id))
            await pipe.execute()

    async def model_statistics(
        self, models: Sequence[tuple[str, int]]
    ) -> list[tuple[RawHash, RawHash, RawHash]]:
        keys = self.keys
        async with self.redis.pipeline(transaction=False) as pipe:
            for name, version in models:
                pipe.hgetall(keys.stats(name, version))
                pipe.hgetall(keys.batch_stats(name, version))
                pipe.hgetall(keys.instance_stats(name, version))
            results = cast(list[RawHash], await pipe.execute())
        return [
            (results[3 * i], results[3 * i + 1], results[3 * i + 2]) for i in range(len(models))
        ]

    async def metric_snapshot(self, view: CatalogView) -> Snapshot:
        return await metric_snapshot.take(self.redis, self.keys, view)

    async def live_workers(self, model: str, version: int, now: float) -> list[bytes | str]:
        key = self.keys.live_workers(model, version)
        return cast(list[bytes | str], await self.redis.zrangebyscore(key, now, "+inf"))

    def script(self, source: str) -> AsyncScript:
        script = self._scripts.get(source)
        if script is None:
            script = self._scripts[source] = self.redis.register_script(source)
        return script
