"""``python -m gateway``: one gateway process under uvicorn (uvloop, httptools)."""

from __future__ import annotations

import logging
import resource
import socket

import uvicorn

from gateway.app import create_app
from gateway.http_protocol import bounded_protocol
from sluice.runtime import tune_garbage_collector
from sluice.settings import GatewaySettings


def _raise_open_file_limit(wanted: int) -> None:
    """Room for ``max_connections`` sockets plus Redis connections and shared memory."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


def serve(settings: GatewaySettings) -> None:
    tune_garbage_collector()
    _raise_open_file_limit(settings.max_connections + 1024)
    protocol = bounded_protocol(
        header_timeout_s=settings.header_timeout_s,
        body_timeout_s=settings.body_timeout_s,
        send_timeout_s=settings.send_timeout_s,
        max_connections=settings.max_connections,
    )
    config = uvicorn.Config(
        create_app(settings),
        host=settings.http_host,
        port=settings.http_port,
        loop="uvloop",
        http=protocol,
        timeout_keep_alive=int(max(1, settings.keep_alive_s)),
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
