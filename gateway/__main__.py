"""``python -m gateway``: one gateway process under uvicorn (uvloop, httptools)."""

from __future__ import annotations

import logging

import uvicorn

from gateway.app import create_app
from sluice.settings import GatewaySettings


def serve(settings: GatewaySettings) -> None:
    uvicorn.run(
        create_app(settings),
        host=settings.http_host,
        port=settings.http_port,
        fd=settings.http_fd if settings.http_fd >= 0 else None,
        loop="uvloop",
        http="httptools",
        access_log=False,
        proxy_headers=False,
        lifespan="on",
        log_level="warning",
        timeout_graceful_shutdown=int(settings.shutdown_timeout_s),
        ssl_certfile=settings.ssl_certfile or None,
        ssl_keyfile=settings.ssl_keyfile or None,
    )


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    serve(GatewaySettings())
