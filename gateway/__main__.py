"""``python -m gateway``: one gateway process under uvicorn (uvloop, httptools)."""

from __future__ import annotations

import logging
import socket

import uvicorn

from gateway.app import create_app
from sluice.runtime import tune_garbage_collector
from sluice.settings import GatewaySettings


def serve(settings: GatewaySettings) -> None:
    tune_garbage_collector()
    config = uvicorn.Config(
        create_app(settings),
        host=settings.http_host,
        port=settings.http_port,
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
    server = uvicorn.Server(config)
    if settings.http_fd >= 0:
        server.run(sockets=[socket.socket(fileno=settings.http_fd)])
    else:
        server.run()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    serve(GatewaySettings())
