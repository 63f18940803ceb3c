"""A :class:`sluice.gateway.control.store.ControlPlane` in memory, for in-process tests of
control routes: rollouts, routing and the model-control mode are plain fields; what these
tests do not reach (scripts, metrics, commands) says so."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from redis.commands.core import AsyncScript

from sluice.core.errors import Unsupported
from sluice.core.routing import Routing
from sluice.gateway.control.catalog_view import CatalogView
from sluice.gateway.control.store import RawHash
from sluice.gateway.metrics.snapshot import Snapshot
from sluice.gateway.redis_room import RedisRoom


@dataclass
class MemoryControlPlane:
    rollouts: dict[str, bytes] = field(default_factory=dict)
    """Model -> its rollout state document."""
    routings: dict[str, Routing] = field(default_factory=dict)
    explicit: bool = False
    statistics: dict[tuple[str, int], RawHash] = field(default_factory=dict)
    """(model, version) -> its request statistics hash."""
    commands: list[tuple[str, Mapping[bytes, bytes]]] = field(default_factory=list)
    reports: list[tuple[Mapping[str, int], int]] = field(default_factory=list)
    """The gauges of each report this process published, with their time to live (s)."""

    async def server_identity(self) -> str:
        return "memory"

    async def sync_clock(self) -> None:
        pass

    async def refresh_catalog(self, view: CatalogView) -> None:
        pass  # (the test sets the view itself)

    async def refresh_routing(self, view: CatalogView) -> None:
        view.routing.models = dict(self.routings)

    async def refresh_room(self, room: RedisRoom) -> None:
        pass

    async def explicit_model_control(self) -> bool:
        return self.explicit

    dropped: list[str] = field(default_factory=list)
    """The ids of the commands taken back (their entries stay in ``commands``)."""

    async def send_command(self, stream: str, fields: Mapping[bytes, bytes]) -> str:
        self.commands.append((stream, fields))
        return f"{len(self.commands)}-0"

    async def drop_command(self, stream: str, entry_id: str) -> None:
        self.dropped.append(entry_id)

    async def take_reply(self, reply_key: str) -> bytes | None:
        return None  # (no executor answers: a command times out)

    async def live_executors(self) -> frozenset[str]:
        return frozenset()

    async def rollout(self, model: str) -> bytes | None:
        return self.rollouts.get(model)

    async def routing(self, model: str) -> Routing:
        return self.routings.get(model, Routing())

    async def update_routing(self, model: str, change: Callable[[Routing], Routing]) -> Routing:
        routing = self.routings[model] = change(await self.routing(model))
        return routing

    async def publish_report(
        self,
        gateway_id: str,
        gauges: Mapping[str, int],
        ttl_s: int,
        now: float,
        counts: Sequence[tuple[str, str, int]],
    ) -> None:
        self.reports.append((dict(gauges), ttl_s))

    async def withdraw_report(self, gateway_id: str) -> None:
        pass

    async def model_statistics(
        self, models: Sequence[tuple[str, int]]
    ) -> list[tuple[RawHash, RawHash, RawHash]]:
        return [(self.statistics.get(model, {}), {}, {}) for model in models]

    async def metric_snapshot(self, view: CatalogView) -> Snapshot:
        raise Unsupported("the memory control plane takes no metric snapshots")

    async def live_workers(self, model: str, version: int, now: float) -> list[bytes | str]:
        return []

    def script(self, source: str) -> AsyncScript:
        raise Unsupported("the memory control plane runs no Lua scripts")
