"""The gateway process's one lifespan: Redis clients, the dispatcher and its reply
reader, the catalog refresh, the shared memory sweeper, the gRPC server and tracing, set
up in that order before the first request and taken down in reverse after the last."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Sequence

from fastapi import FastAPI
from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError

from sluice.core.dispatch import RedisDispatcher
from sluice.core.hosts import host_id
from sluice.core.keys import Keys
from sluice.core.observability.tracing import tracing_from_settings
from sluice.core.redis_client.connect import connect_async
from sluice.core.response_cache import ResponseCache
from sluice.core.settings import GatewaySettings
from sluice.gateway.admission import Admission
from sluice.gateway.body_budget import BodyBudget
from sluice.gateway.control.catalog_refresh import refresh, refresh_loop
from sluice.gateway.control.catalog_view import CatalogView
from sluice.gateway.control.gateway_report import withdraw
from sluice.gateway.control.store import RedisControlPlane
from sluice.gateway.grpc_api.server import GrpcServer
from sluice.gateway.inference.request import RequestLimits
from sluice.gateway.jobs.store_sweep import store_sweep_loop
from sluice.gateway.redis_room import RedisRoom
from sluice.gateway.shm.registry import RegionRegistry
from sluice.gateway.shm.store import REGIONS_TTL_S, HostCounter, RedisRegionStore
from sluice.gateway.shm.sweep import sweep_loop, sweep_now
from sluice.gateway.shm.transfer import TensorTransfer
from sluice.gateway.state import GatewayState
from sluice.gateway.tenants.limits_source import LimitsSource, load_at_start
from sluice.gateway.tenants.quota import TenantQuota

_READER_EXTRA_TIMEOUT_S = 5
"""The reader blocks up to 4 s in XREAD (``sluice.core.dispatch``), so its socket timeout
must be longer."""


def _connect(settings: GatewaySettings, socket_timeout_s: float) -> Redis:
    return connect_async(
        settings.redis_url,
        socket_connect_timeout=settings.redis_timeout_s,
        socket_timeout=socket_timeout_s,
        retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
    )


def _state(
    settings: GatewaySettings, redis: Redis, reader: Redis, limits: LimitsSource
) -> tuple[GatewayState, RedisDispatcher]:
    """The process state, and its dispatcher (as the Redis one the lifespan drives)."""
    keys = Keys(settings.namespace)
    host = host_id(settings.host_id)
    regions = RegionRegistry.from_settings(
        settings,
        RedisRegionStore(redis, keys, host, max(REGIONS_TTL_S, 20 * settings.catalog_refresh_s)),
        HostCounter(settings.namespace, host),
        host,
    )
    transfer = TensorTransfer.from_settings(settings, regions)
    dispatcher = RedisDispatcher(
        redis,
        reader,
        keys,
        stream_max_len=settings.stream_max_len,
        on_unclaimed=transfer.discard_reply,
    )
    state = GatewayState(
        settings=settings,
        keys=keys,
        redis=redis,
        view=CatalogView(
            keys,
            namespacing=settings.model_namespacing,
            sole_repository=_sole(settings.model_repository),
        ),
        dispatcher=dispatcher,
        limits=RequestLimits(max_elements=settings.max_tensor_elements),
        admission=Admission(
            settings.max_in_flight,
            weight=limits.loaded.weight,
            fresh_s=2 * settings.catalog_refresh_s,
        ),
        regions=regions,
        transfer=transfer,
        bodies=BodyBudget(max(settings.max_buffered_body_bytes, settings.max_body_bytes)),
        control=RedisControlPlane(redis, keys),
        redis_room=RedisRoom(settings.redis_memory_high_water),
        host_changes=HostCounter(settings.namespace, host, topic="changes"),
        quota=TenantQuota(
            limits.tenants, limits=limits.loaded, processes=settings.gateway_processes
        ),
        limits_source=limits,
    )
    state.cache = ResponseCache.from_settings(redis, keys, settings, settings.redis_url)
    state.host_seen = state.host_changes.value()
    return state, dispatcher


def gateway_lifespan(
    settings: GatewaySettings, exiting: asyncio.Event | None = None
) -> Callable[[FastAPI], contextlib.AbstractAsyncContextManager[None]]:
    """The lifespan, for :class:`FastAPI`; the state goes to ``app.state.sluice``. The
    tenant limits are read now: InvalidConfig when they cannot be used. Once ``exiting`` is
    set (the server was asked to stop), gRPC drains while the server drains HTTP."""
    limits = load_at_start(settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        redis = _connect(settings, settings.redis_timeout_s)
        reader = _connect(settings, settings.redis_timeout_s + _READER_EXTRA_TIMEOUT_S)
        state, dispatcher = _state(settings, redis, reader, limits)
        app.state.sluice = state
        await dispatcher.start()
        # Know the catalog before the first request: a gateway restarted under load
        # otherwise answers what waited in the listen backlog with 503s.
        await refresh(state, dispatcher, touch=True)
        refresher = asyncio.create_task(refresh_loop(state, dispatcher), name="catalog-refresh")
        sweeper = asyncio.create_task(sweep_loop(state), name="shm-sweeper")
        store_sweeper = asyncio.create_task(store_sweep_loop(state), name="store-sweeper")
        grpc_server = GrpcServer(state) if settings.grpc_port else None
        stop_signal = exiting if exiting is not None else asyncio.Event()
        grpc_drain: asyncio.Task[None] | None = None
        try:
            if grpc_server is not None:
                await grpc_server.start()
                grpc_drain = asyncio.create_task(
                    _stop_when_set(stop_signal, grpc_server, settings.shutdown_timeout_s),
                    name="grpc-drain",
                )
            state.tracing = tracing_from_settings(settings, "gateway")
            yield
        finally:
            stop_signal.set()
            if grpc_drain is not None:
                await grpc_drain
            for task in (refresher, sweeper, store_sweeper):
                task.cancel()
            await asyncio.gather(refresher, sweeper, store_sweeper, return_exceptions=True)
            await withdraw(state, dispatcher.gateway_id)
            await dispatcher.stop()
            state.regions.close_local()  # (the host's records stay, for its other gateways)
            state.regions.counter.close()
            state.host_changes.close()
            sweep_now(state, final=True)
            await redis.aclose()
            await reader.aclose()
            tracing, state.tracing = state.tracing, None
            if tracing is not None:  # what is left is exported once all else has stopped
                await asyncio.to_thread(tracing.shutdown)

    return lifespan


async def _stop_when_set(exiting: asyncio.Event, server: GrpcServer, grace_s: float) -> None:
    """gRPC's drain, begun as soon as the gateway is asked to stop: new calls are refused
    and the calls in flight get ``grace_s`` while HTTP drains its own, at the same time."""
    await exiting.wait()
    await server.stop(grace_s)


def _sole(repositories: Sequence[str]) -> str:
    """The one model repository named, if only one is (every model's namespace with model
    namespacing); empty otherwise."""
    return repositories[0] if len(repositories) == 1 else ""
