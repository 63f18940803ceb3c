"""Everything a gateway process holds between requests."""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from redis.asyncio import Redis
from starlette.requests import Request

from sluice.core.dispatch import Dispatcher
from sluice.core.keys import Keys
from sluice.core.queue_streams import TenantStreams
from sluice.core.response_cache import ResponseCache
from sluice.core.settings import GatewaySettings
from sluice.gateway.admission import Admission
from sluice.gateway.body_budget import BodyBudget
from sluice.gateway.control.catalog_view import CatalogView
from sluice.gateway.control.store import ControlPlane
from sluice.gateway.inference.request import RequestLimits
from sluice.gateway.redis_room import RedisRoom
from sluice.gateway.shm.registry import RegionRegistry
from sluice.gateway.shm.store import ChangeCounter, LocalCounter
from sluice.gateway.shm.transfer import TensorTransfer
from sluice.gateway.tenants.limits_source import LimitsSource
from sluice.gateway.tenants.quota import TenantQuota

if TYPE_CHECKING:  # (the tracing SDK is imported only when tracing is on)
    from sluice.core.observability.otel import Tracing


@dataclass
class GatewayState:
    settings: GatewaySettings
    keys: Keys
    redis: Redis
    """The Redis client of the request records (jobs, uploads, batches); the control plane
    goes through ``control``, the data plane through ``dispatcher``."""
    view: CatalogView
    dispatcher: Dispatcher
    limits: RequestLimits
    admission: Admission
    regions: RegionRegistry
    """Shared memory regions clients registered with this gateway."""
    transfer: TensorTransfer
    """How tensor bytes travel to the workers and back (entry or shared memory)."""
    bodies: BodyBudget
    """Request-body bytes held by this process, within SLUICE_MAX_BUFFERED_BODY_BYTES."""
    control: ControlPlane
    """Catalog, model control, rollouts, routing, statistics, metrics, Lua scripts."""
    redis_room: RedisRoom = field(default_factory=lambda: RedisRoom(0.0))
    """Room left in Redis (its memory, read in the periodic refresh): ``redis_room.check()``
    refuses new work that would add to a Redis above SLUICE_REDIS_MEMORY_HIGH_WATER."""
    quota: TenantQuota = field(default_factory=TenantQuota)
    """Each tenant's limits in force here, and what its requests hold."""
    limits_source: LimitsSource = field(default_factory=LimitsSource)
    """Where the tenant limits come from (the file followed for changes)."""
    redis_ok: bool = field(default=False)
    refreshed: asyncio.Event = field(default_factory=asyncio.Event)
    """Set at the end of each catalog refresh (readiness may have changed): the gRPC health
    status follows it instead of polling."""
    redis_run_id: str = ""
    """The Redis server's run id: another one means Redis restarted and lost its streams."""
    tracing: Tracing | None = None
    """Set by the lifespan when tracing is configured (an OTLP endpoint)."""
    host_changes: ChangeCounter = field(default_factory=LocalCounter)
    """Moved by the gateway process that carried out a model-control change (a load, an
    unload) or a log-settings change, so that the other gateway processes of its host catch
    up before their next request (:func:`sluice.gateway.control.catalog_follow.follow_changes`)."""
    host_seen: int = 0
    """``host_changes`` when this process last caught up."""
    host_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    miss_refreshed_at: float = float("-inf")
    """When a request that missed last made this process refresh its catalog."""
    redis_checked_at: float = float("-inf")
    """When a request last made this process look whether Redis is back."""
    redis_check: asyncio.Task[None] | None = None
    """That look, while it runs."""
    torchserve_responses: Counter[str] = field(default_factory=Counter)
    """Answers of this process's TorchServe ports by class (``2XX``, ``4XX``, ``5XX``)
    since its last report (:mod:`sluice.gateway.torchserve.ports`)."""
    tenant_streams: TenantStreams = field(default_factory=TenantStreams)
    """The tenant streams this process made known (:mod:`sluice.gateway.tenants.streams`)."""
    cache: ResponseCache | None = None
    """Triton's response cache, where the deployment has one (:mod:`.response_cache`)."""
    scrape: asyncio.Task[bytes] | None = None
    """The ``/metrics`` text being taken, which the scrapes arriving meanwhile share
    (:func:`sluice.gateway.metrics.exposition.metrics_text`)."""
    torchserve_scrape: asyncio.Task[bytes] | None = None
    """The same for TorchServe's metrics port
    (:func:`sluice.gateway.torchserve.ports.metrics_text`)."""


def state_of(request: Request) -> GatewayState:
    """The gateway's state, for a route handler."""
    state: GatewayState = request.app.state.sluice
    return state
