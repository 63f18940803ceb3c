"""TorchServe's metrics port under scrapes that arrive together: like Sluice's own
``/metrics``, they share one read of Redis (and one rendering), each answered with the
families its ``name[]`` asks for; and, as there, a scrape while Redis is unreachable is
answered 503, not 500."""

from __future__ import annotations

import asyncio
import socket
import uuid
from types import SimpleNamespace

import httpx
import uvicorn
from fastapi import FastAPI
from prometheus_client.parser import text_string_to_metric_families
from redis.asyncio import Redis
from starlette.types import ASGIApp, Receive, Scope, Send

from sluice.core.errors import QUEUE_UNREACHABLE
from sluice.core.keys import Keys
from sluice.core.settings import GatewaySettings
from sluice.gateway.control.catalog_view import CatalogView
from sluice.gateway.control.store import RedisControlPlane
from sluice.gateway.metrics.snapshot import Snapshot
from sluice.gateway.torchserve.ports import TorchServeMetrics
from sluice.scheduler.executor.redis_server import free_port

SCRAPES = 20


class _GatedControl(RedisControlPlane):
    """The control plane in Redis, counting its metric reads, each of which waits until
    released (so that every scrape arrives while the first is being taken)."""

    def __init__(self, redis: Redis, keys: Keys) -> None:
        super().__init__(redis, keys)
        self.reads = 0
        self.release = asyncio.Event()

    async def metric_snapshot(self, view: CatalogView) -> Snapshot:
        self.reads += 1
        await self.release.wait()
        return await super().metric_snapshot(view)


class _Arrivals:
    """``app``, counting the requests that reached it."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.count = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.count += 1
        await self.app(scope, receive, send)


async def test_scrapes_that_arrive_together_read_redis_once(redis: Redis) -> None:
    keys = Keys(f"t{uuid.uuid4().hex[:8]}")
    control = _GatedControl(redis, keys)
    routes = FastAPI()
    routes.state.sluice = SimpleNamespace(
        control=control, view=CatalogView(keys), settings=GatewaySettings(), torchserve_scrape=None
    )
    port = _Arrivals(TorchServeMetrics(routes, hostname="host-a"))
    server = uvicorn.Server(uvicorn.Config(port, lifespan="off", log_level="error"))
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    serving = asyncio.create_task(server.serve(sockets=[listener]))
    url = f"http://127.0.0.1:{listener.getsockname()[1]}/metrics"
    limits = httpx.Limits(max_connections=SCRAPES)
    try:
        async with asyncio.timeout(60), httpx.AsyncClient(timeout=30, limits=limits) as http:
            while not server.started:
                await asyncio.sleep(0.01)
            whole = [asyncio.create_task(http.get(url)) for _ in range(SCRAPES // 2)]
            only = [
                asyncio.create_task(http.get(url, params={"name[]": "Requests4XX"}))
                for _ in range(SCRAPES // 2)
            ]
            while port.count < SCRAPES:  # every scrape has arrived, the first still reading
                await asyncio.sleep(0.01)
            control.release.set()
            answers = await asyncio.gather(*whole, *only)
            assert [a.status_code for a in answers] == [200] * SCRAPES
            assert control.reads == 1
            texts = [a.text for a in answers]
            assert len(set(texts[: SCRAPES // 2])) == 1 and len(set(texts[SCRAPES // 2 :])) == 1
            names = [f.name for f in text_string_to_metric_families(texts[0])]
            assert {"Requests2XX", "Requests4XX", "Requests5XX"} <= set(names)
            filtered = [f.name for f in text_string_to_metric_families(texts[-1])]
            assert filtered == ["Requests4XX"]
            # A scrape after that one reads again.
            assert (await http.get(url)).status_code == 200
            assert control.reads == 2
    finally:
        server.should_exit = True
        await serving


async def test_a_scrape_while_redis_is_unreachable_is_answered_503() -> None:
    """A Redis nobody listens for: the port answers as Sluice's own ``/metrics`` does (503,
    saying that Redis is unreachable, in TorchServe's error body), not with a bare 500."""
    unreachable = Redis.from_url(f"redis://127.0.0.1:{free_port()}/0", socket_timeout=2)
    keys = Keys(f"t{uuid.uuid4().hex[:8]}")
    routes = FastAPI()
    routes.state.sluice = SimpleNamespace(
        control=RedisControlPlane(unreachable, keys),
        view=CatalogView(keys),
        settings=GatewaySettings(),
        torchserve_scrape=None,
    )
    transport = httpx.ASGITransport(app=TorchServeMetrics(routes, hostname="host-a"))
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://metrics") as http:
            answer = await http.get("/metrics")
            assert answer.status_code == 503, answer.text
            assert answer.json() == {
                "code": 503,
                "type": "ServiceUnavailableException",
                "message": QUEUE_UNREACHABLE,
            }
            assert (await http.get("/metrics", params={"name[]": "Requests2XX"})).status_code == 503
    finally:
        await unreachable.aclose()
