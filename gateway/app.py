"""The FastAPI application and its lifespan (Redis clients, catalog refresh, reply reader)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp

from sluice.core.clock import CLOCK
from sluice.core.dispatch import RedisDispatcher
from sluice.core.errors import Overloaded, SluiceError, Unavailable
from sluice.core.keys import Keys
from sluice.core.redis_connect import connect_async, server_identity
from sluice.core.settings import GatewaySettings
from sluice.core.shm import sweep_orphans
from sluice.gateway.admission import Admission
from sluice.gateway.body_budget import BodyBudget
from sluice.gateway.catalog_view import CatalogView
from sluice.gateway.fast_path import InferFastPath
from sluice.gateway.gateway_report import report
from sluice.gateway.generate_routes import router as generate_router
from sluice.gateway.grpc_api.server import GrpcServer
from sluice.gateway.guard import EdgeGuard, KeyRing
from sluice.gateway.infer_request import RequestLimits
from sluice.gateway.infer_response import encode_error
from sluice.gateway.redis_room import RedisRoom
from sluice.gateway.routes import router
from sluice.gateway.shm_registry import RegionRegistry
from sluice.gateway.shm_transfer import TensorTransfer
from sluice.gateway.state import GatewayState
from sluice.gateway.torchserve_management import router as torchserve_management
from sluice.gateway.torchserve_routes import router as torchserve_router

log = logging.getLogger(__name__)

_TOUCH_EVERY = 20
"""Catalog refreshes between two renewals of the reply stream's expiry."""


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> Response:
    return Response(encode_error(message), status, headers=headers, media_type="application/json")


async def _sluice_error(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, SluiceError)
    headers = {"Retry-After": str(exc.retry_after_s)} if isinstance(exc, Overloaded) else None
    return _error(int(exc.status), exc.message, headers)


async def _redis_error(_: Request, exc: Exception) -> Response:
    return _error(503, f"the request queue (Redis) is unreachable; retry later ({exc})")


async def _http_error(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return _error(exc.status_code, str(exc.detail), getattr(exc, "headers", None))


async def _validation_error(_: Request, exc: Exception) -> Response:
    return _error(400, f"invalid request: {exc}")


async def _unexpected_error(_: Request, exc: Exception) -> Response:
    """Starlette answers plain text otherwise; clients always get ``{"error": ...}``."""
    log.error("request failed", exc_info=exc)
    return _error(500, f"internal error: {type(exc).__name__}")


async def _refresh(state: GatewayState, dispatcher: RedisDispatcher, touch: bool) -> None:
    """Catalog, readiness and queue depths from Redis; notices Redis going away or
    restarting (a new run id: the queued requests are gone with it), and fails the
    requests waiting here at once instead of at their deadlines."""
    try:
        started = time.perf_counter()
        run_id = await server_identity(state.redis)
        round_trip_s = time.perf_counter() - started
        await CLOCK.sync(state.redis)  # (the deadlines it writes are read on other hosts)
        await state.view.refresh(state.redis)
        await state.view.routing.refresh(state.redis, state.keys, state.view.models)
        state.admission.observe(state.view.depths)
        await state.redis_room.refresh(state.redis)
        await report(state, dispatcher.gateway_id, round_trip_s)
        if touch:
            await dispatcher.touch()
        if state.redis_run_id and run_id != state.redis_run_id:
            log.warning("Redis restarted: failing the requests it lost")
            dispatcher.fail_all(Unavailable("the request queue (Redis) restarted; retry"))
        state.redis_run_id = run_id
        if not state.redis_ok:
            log.info("connected to Redis")
        state.redis_ok = True
    except RedisError as exc:
        if state.redis_ok:
            log.warning("Redis is unreachable: %s", exc)
            dispatcher.fail_all(
                Unavailable("the request queue (Redis) became unreachable; retry later")
            )
        state.redis_ok = False
    except Exception:
        log.exception("catalog refresh failed")


async def _refresh_loop(state: GatewayState, dispatcher: RedisDispatcher) -> None:
    ticks = 1  # the lifespan made the first refresh
    while True:
        await asyncio.sleep(state.settings.catalog_refresh_s)
        await _refresh(state, dispatcher, touch=ticks % _TOUCH_EVERY == 0)
        ticks += 1


def _longest_timeout_s(state: GatewayState) -> float:
    """The longest deadline a request can get (setting or model queue policy)."""
    longest = state.settings.default_timeout_s
    for entry in state.view.models.values():
        dynamic = entry.config.dynamic_batching if entry.config is not None else None
        if dynamic is not None:
            longest = max(longest, dynamic.default_timeout_us / 1e6)
    return longest


async def _sweep_loop(state: GatewayState) -> None:
    """Remove shared memory segments whose creator died, or whose reader gave up."""
    while True:
        try:
            await asyncio.to_thread(
                sweep_orphans, state.settings.namespace, 2 * _longest_timeout_s(state)
            )
        except Exception:
            log.exception("sweeping shared memory segments failed")
        await asyncio.sleep(state.settings.shm_sweep_interval_s)


def create_app(settings: GatewaySettings) -> ASGIApp:
    """The gateway: edge checks, then the inference fast path, then the FastAPI routes."""
    return guarded(settings, InferFastPath(create_fastapi_app(settings)))


def guarded(settings: GatewaySettings, app: ASGIApp) -> ASGIApp:
    """``app`` behind the edge checks: header limits, API keys, control body limits."""
    return EdgeGuard(
        app,
        keys=KeyRing.from_settings(settings),
        max_header_count=settings.max_header_count,
        max_header_bytes=settings.max_header_bytes,
        max_control_body_bytes=settings.max_control_body_bytes,
    )


def create_fastapi_app(settings: GatewaySettings) -> FastAPI:
    keys = Keys(settings.namespace)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        timeout = settings.redis_timeout_s
        redis = connect_async(
            settings.redis_url,
            socket_connect_timeout=timeout,
            socket_timeout=timeout,
            retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
        )
        # The reader blocks up to 1 s in XREAD, so its socket timeout must be longer.
        reader = connect_async(
            settings.redis_url,
            socket_connect_timeout=timeout,
            socket_timeout=timeout + 5,
            retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
        )
        regions = RegionRegistry.from_settings(settings)
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
            view=CatalogView(keys),
            dispatcher=dispatcher,
            limits=RequestLimits(max_elements=settings.max_tensor_elements),
            admission=Admission(settings.max_in_flight),
            regions=regions,
            transfer=transfer,
            bodies=BodyBudget(max(settings.max_buffered_body_bytes, settings.max_body_bytes)),
            redis_room=RedisRoom(settings.redis_memory_high_water),
        )
        app.state.sluice = state
        await dispatcher.start()
        # Know the catalog before the first request: a gateway restarted under load
        # otherwise answers what waited in the listen backlog with 503s.
        await _refresh(state, dispatcher, touch=True)
        refresher = asyncio.create_task(_refresh_loop(state, dispatcher), name="catalog-refresh")
        sweeper = asyncio.create_task(_sweep_loop(state), name="shm-sweeper")
        grpc_server = GrpcServer(state) if settings.grpc_port else None
        try:
            if grpc_server is not None:
                await grpc_server.start()
            yield
        finally:
            if grpc_server is not None:
                await grpc_server.stop(settings.shutdown_timeout_s)
            refresher.cancel()
            sweeper.cancel()
            await asyncio.gather(refresher, sweeper, return_exceptions=True)
            await dispatcher.stop()
            with contextlib.suppress(SluiceError):
                regions.unregister_cuda(None)
            sweep_orphans(settings.namespace, 2 * _longest_timeout_s(state), grace_s=0)
            await redis.aclose()
            await reader.aclose()

    app = FastAPI(title="Sluice", version="v2", lifespan=lifespan)
    app.include_router(router)
    app.include_router(torchserve_router)
    app.include_router(generate_router)
    app.include_router(torchserve_management)
    app.add_exception_handler(SluiceError, _sluice_error)
    app.add_exception_handler(RedisError, _redis_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(Exception, _unexpected_error)
    return app
