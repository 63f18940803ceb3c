"""The gateway's upload, batch and job routes in-process, over a real redis-server: the
process state the lifespan builds, the edge guard with two tenants' keys, one model in the
catalog view, and no reply reader, catalog refresh or sweeper running (a test drives
what it needs). Requests go through httpx's ASGI transport, so a test can reach between
two steps of a route (a monkeypatched helper) deterministically."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI
from redis.asyncio import Redis

from sluice.core.catalog import CatalogEntry
from sluice.core.config.parse import parse_config_text
from sluice.core.keys import Keys
from sluice.core.settings import GatewaySettings
from sluice.gateway.app import _guarded
from sluice.gateway.http.errors import add_error_handlers
from sluice.gateway.jobs.batch_routes import batch_router
from sluice.gateway.jobs.job_routes import job_router
from sluice.gateway.jobs.upload_routes import upload_router
from sluice.gateway.lifespan import _connect, _state
from sluice.gateway.state import GatewayState
from sluice.gateway.tenants.limits_source import load_at_start
from tests.support.onnx_models import identity_config

KEYS = {"team-a": "key-a", "team-b": "key-b"}
MODEL = "ident"


@dataclass
class BatchGateway:
    state: GatewayState
    redis: Redis
    store: Path
    app: Any

    @property
    def keys(self) -> Keys:
        return self.state.keys

    def client(self, tenant: str) -> httpx.AsyncClient:
        """A client with ``tenant``'s key (the caller closes it)."""
        return httpx.AsyncClient(
            transport=httpx.ASGITransport(app=self.app),
            base_url="http://gateway",
            headers={"Authorization": f"Bearer {KEYS[tenant]}"},
            timeout=30,
        )

    async def upload(self, tenant: str, data: bytes = b"{}\n") -> str:
        """A new upload of ``tenant`` holding ``data``; its id."""
        async with self.client(tenant) as client:
            answer = await client.post("/v2/uploads?name=rows.jsonl", content=data)
        assert answer.status_code == 201, answer.text
        upload_id: str = answer.json()["id"]
        return upload_id

    async def submit(self, tenant: str, upload_id: str) -> dict[str, Any]:
        """A job of ``tenant`` over its upload ``upload_id``: the 201's body."""
        async with self.client(tenant) as client:
            answer = await client.post(
                "/v2/batches", json={"model": MODEL, "input": f"upload:{upload_id}"}
            )
        assert answer.status_code == 201, answer.text
        body: dict[str, Any] = answer.json()
        return body


@asynccontextmanager
async def batch_gateway(
    redis_url: str, store: Path, **settings: Any
) -> AsyncIterator[BatchGateway]:
    """The routes of a gateway whose namespace is the test's own, with ``settings`` on top."""
    gateway_settings = GatewaySettings(
        redis_url=redis_url,
        namespace=f"t{uuid.uuid4().hex[:8]}",
        api_keys=",".join(f"{t}:{k}" for t, k in KEYS.items()),
        batch_store=str(store),
        **settings,
    )
    redis = _connect(gateway_settings, 5)
    state, _ = _state(gateway_settings, redis, redis, load_at_start(gateway_settings))
    config = parse_config_text(identity_config(MODEL, ["FP32"], (4,), 8), model_name=MODEL)
    state.view.models = {MODEL: CatalogEntry(MODEL, (1,), config)}
    routes = FastAPI()
    routes.include_router(upload_router)
    routes.include_router(batch_router)
    routes.include_router(job_router)
    add_error_handlers(routes)
    routes.state.sluice = state
    try:
        yield BatchGateway(state, redis, store, _guarded(gateway_settings, routes))
    finally:
        state.regions.close_local()
        state.regions.counter.close()
        state.host_changes.close()
        await redis.aclose()
