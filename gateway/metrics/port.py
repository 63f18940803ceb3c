"""The metrics port (Triton's 8002): ``GET /metrics`` and nothing else.

It answers from the same process state as the HTTP port, so a scrape of either gives the
same text; a separate port lets operators expose metrics to Prometheus without exposing
inference, as with Triton.
"""

from __future__ import annotations

from fastapi import FastAPI
from redis.exceptions import RedisError
from starlette.types import Receive, Scope, Send

from sluice.core.errors import QUEUE_UNREACHABLE
from sluice.gateway.inference.response import encode_error
from sluice.gateway.metrics.exposition import CONTENT_TYPE, metrics_text


class MetricsOnly:
    def __init__(self, app: FastAPI) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        if scope["path"] != "/metrics":
            await answer(send, 404, encode_error("Not Found"), b"application/json")
            return
        if scope["method"] != "GET":
            await answer(send, 405, encode_error("Method Not Allowed"), b"application/json")
            return
        state = getattr(self.app.state, "sluice", None)
        if state is None:
            await answer(send, 503, encode_error("the gateway is starting"), b"application/json")
            return
        if not state.settings.allow_metrics:
            await answer(send, 404, encode_error("metrics are turned off"), b"application/json")
            return
        try:
            body = await metrics_text(state)
        except RedisError:  # (as the HTTP port answers it, not a 500 with a traceback)
            await answer(send, 503, encode_error(QUEUE_UNREACHABLE), b"application/json")
            return
        await answer(send, 200, body, CONTENT_TYPE.encode())


async def answer(send: Send, status: int, body: bytes, content_type: bytes) -> None:
    headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
