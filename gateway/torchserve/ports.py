"""TorchServe's three ports: inference (its 8080), management (8081) and metrics (8082).

TorchServe's users call its APIs on separate ports: clients the inference port, operators the
management port, Prometheus the metrics port, and each port answers only its own API (a
management call on the inference port is TorchServe's 404). Each port here is the same
gateway application behind a filter that lets through its API's paths only, so API keys,
limits and answers are those of Sluice's own HTTP port; the filters count the answers by
class for TorchServe's ``Requests2XX`` / ``Requests4XX`` / ``Requests5XX``.

The metrics port answers TorchServe's Prometheus text (``metrics_mode=prometheus``): its
frontend counters with TorchServe's names, HELP texts and labels (``Level``, ``Hostname``;
``model_name``, ``model_version``, ``hostname``), summed over the gateway processes through
Redis like every Sluice counter, and TorchServe's ``name[]`` filter. Scrapes that arrive
while one is being taken share its Redis read and its text, as on Sluice's own
``/metrics``, and a scrape while Redis is unreachable is answered 503 as there.

Each port also describes its API, as TorchServe's do (``OPTIONS /``, ``/api-description``:
:mod:`sluice.gateway.torchserve.api_description`). On the inference and management ports
the description is answered ahead of the API keys, as TorchServe answers it ahead of its
token authorization: it is the route table, the same for every deployment (the metrics
port's is behind the key its ``/metrics`` asks for).
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qs

from fastapi import FastAPI
from redis.exceptions import RedisError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sluice.core.errors import QUEUE_UNREACHABLE
from sluice.gateway.control.gateway_report import TORCHSERVE_RESPONSES
from sluice.gateway.metrics.host import escape_label, family
from sluice.gateway.metrics.port import answer
from sluice.gateway.metrics.snapshot import Snapshot
from sluice.gateway.metrics.torchserve_families import torchserve_lines
from sluice.gateway.state import GatewayState
from sluice.gateway.torchserve.api_description import PortDescription, port_document
from sluice.gateway.torchserve.system import SystemGauges

RESPONSE_CLASSES = ("2XX", "4XX", "5XX")

_NOT_FOUND = json.dumps(
    {
        "code": 404,
        "type": "ResourceNotFoundException",
        "message": "Requested resource is not found, please refer to API document.",
    }
).encode()

_UNREACHABLE = json.dumps(
    {"code": 503, "type": "ServiceUnavailableException", "message": QUEUE_UNREACHABLE}
).encode()

_INFERENCE_PATHS = (
    "/predictions/",
    "/explanations/",
    "/wfpredict/",
    "/v1/models/",
    "/v2/models/",
    "/v2/health/",
)
_MANAGEMENT_PATHS = ("/models/", "/workflows/")


def inference_path(path: str) -> bool:
    """TorchServe's inference API: ``/ping``, predictions, explanations and workflow
    predictions, KServe's v1 and v2 inference, and the API description."""
    return path in ("/", "/ping", "/api-description") or path.startswith(_INFERENCE_PATHS)


def management_path(path: str) -> bool:
    """TorchServe's management API: ``/models`` and ``/workflows`` and below, and the API
    description."""
    return path in ("/", "/models", "/workflows", "/api-description") or path.startswith(
        _MANAGEMENT_PATHS
    )


def response_class(status: int) -> str | None:
    """``2XX``, ``4XX`` or ``5XX`` (TorchServe counts no others)."""
    name = f"{status // 100}XX"
    return name if name in RESPONSE_CLASSES else None


class TorchServePort:
    """The gateway application ``app``, for the paths of one TorchServe API only; what it
    answers is counted by class in the process state of ``routes`` (handed to the shared
    counters by the gateway's report)."""

    def __init__(self, app: ASGIApp, routes: FastAPI, allowed: Callable[[str], bool]) -> None:
        self.app = app
        self.routes = routes
        self.allowed = allowed
        self.description = PortDescription(lambda: port_document(routes.openapi(), allowed))

    def _count(self, status: int) -> None:
        state = getattr(self.routes.state, "sluice", None)
        kind = response_class(status)
        if state is not None and kind is not None:
            state.torchserve_responses[kind] += 1

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return  # (no lifespan: the HTTP port's application runs it)
        if not self.allowed(scope["path"]):
            self._count(404)
            await answer(send, 404, _NOT_FOUND, b"application/json")
            return

        async def counted(message: Message) -> None:
            if message["type"] == "http.response.start":
                self._count(int(message["status"]))
            await send(message)

        if await self.description.answer(scope, counted):
            return
        await self.app(scope, receive, counted)


METRICS_PATHS: dict[str, Any] = {
    "/metrics": {
        "get": {
            "summary": "TorchServe's metrics, in Prometheus' text format",
            "operationId": "metrics",
            "parameters": [
                {
                    "name": "name[]",
                    "in": "query",
                    "required": False,
                    "description": "Only the families named (the parameter repeated for more)",
                    "schema": {"type": "array", "items": {"type": "string"}},
                    "style": "form",
                    "explode": True,
                }
            ],
            "responses": {
                "200": {
                    "description": "The metrics",
                    "content": {"text/plain; version=0.0.4": {"schema": {"type": "string"}}},
                }
            },
        }
    }
}
"""What the metrics port serves beside its description (it has no route table)."""


class TorchServeMetrics:
    """``GET /metrics`` in TorchServe's Prometheus text, and the port's description; every
    other path is its 404."""

    def __init__(self, routes: FastAPI, hostname: str | None = None) -> None:
        self.routes = routes
        self.hostname = hostname or socket.gethostname()
        self.description = PortDescription(
            lambda: port_document(routes.openapi(), lambda _: False, METRICS_PATHS)
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        if await self.description.answer(scope, send):
            return
        if scope["path"] != "/metrics":
            await answer(send, 404, _NOT_FOUND, b"application/json")
            return
        state = getattr(self.routes.state, "sluice", None)
        if state is None:
            await answer(send, 503, b'{"code": 503, "message": "starting"}', b"application/json")
            return
        if not state.settings.allow_metrics:
            await answer(send, 404, _NOT_FOUND, b"application/json")
            return
        query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
        wanted = frozenset(query.get("name[]", []))
        try:
            text = await metrics_text(state, self.hostname)
        except RedisError:  # (as Sluice's own /metrics answers it, not a bare 500)
            await answer(send, 503, _UNREACHABLE, b"application/json")
            return
        if wanted:
            text = await asyncio.to_thread(only, text, wanted)
        await answer(send, 200, text, b"text/plain; version=0.0.4; charset=utf-8")


async def metrics_text(state: GatewayState, hostname: str) -> bytes:
    """The metrics port's whole text. Scrapes that arrive while one is being taken get its
    text (each then filters it by its own ``name[]``): however many clients scrape at once,
    a process reads Redis and renders for one of them at a time, as for Sluice's own
    ``/metrics`` (:func:`sluice.gateway.metrics.exposition.metrics_text`). The scrape goes on
    if the client that started it leaves."""
    running = state.torchserve_scrape
    if running is None or running.done():
        running = state.torchserve_scrape = asyncio.create_task(_scrape(state, hostname))
    return await asyncio.shield(running)


async def _scrape(state: GatewayState, hostname: str) -> bytes:
    snapshot = await state.control.metric_snapshot(state.view)
    return await asyncio.to_thread(render, snapshot, hostname)


def render(snapshot: Snapshot, hostname: str) -> bytes:
    """TorchServe's frontend families and the host's gauges. The answer counts are those the
    gateway processes reported (each within seconds), so that every process's scrape says
    the same."""
    host = escape_label(hostname)
    lines: list[str] = []
    for kind in RESPONSE_CLASSES:
        name = f"Requests{kind}"
        total = snapshot.gateway_counters.get(TORCHSERVE_RESPONSES + kind, 0)
        family(lines, name, "Torchserve prometheus counter metric with unit: Count", "counter")
        lines.append(f'{name}{{Level="Host",Hostname="{host}",}} {float(total)}')
    lines += torchserve_lines(snapshot, hostname)
    lines += _SYSTEM.lines(hostname)
    return ("\n".join(lines) + "\n").encode()


_SYSTEM = SystemGauges()
"""The host's gauges (CPU utilization since this port's previous scrape in this process)."""


def only(text: bytes, wanted: frozenset[str]) -> bytes:
    """``text`` with the families in ``wanted`` only (TorchServe's ``name[]`` filter)."""
    lines = text.decode().splitlines()
    return ("\n".join(_only(lines, wanted)) + "\n").encode()


def _only(lines: list[str], wanted: frozenset[str]) -> list[str]:
    kept: list[str] = []
    for line in lines:
        words = line.replace("{", " ").split()
        name = words[2] if line.startswith("#") and len(words) > 2 else words[0] if words else ""
        if name in wanted:
            kept.append(line)
    return kept
