"""``python -m sluice.gateway``: one gateway process under uvicorn (uvloop, httptools)."""

from __future__ import annotations

import asyncio
import contextlib
import resource
import socket
import sys
from collections.abc import Iterator

import uvicorn
import uvloop

from sluice.core.runtime import tune_garbage_collector
from sluice.core.settings import GatewaySettings
from sluice.gateway.app import create_app
from sluice.gateway.http_protocol import bounded_protocol


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
    app = create_app(settings)
    options = {
        "host": settings.http_host,
        "loop": "uvloop",
        "http": protocol,
        "timeout_keep_alive": int(max(1, settings.keep_alive_s)),
        "access_log": False,
        "proxy_headers": False,
        "log_level": "warning",
        "log_config": None,  # uvicorn's lines go through Sluice's logging (JSON when set)
        "timeout_graceful_shutdown": int(settings.shutdown_timeout_s),
        "ssl_certfile": settings.ssl_certfile or None,
        "ssl_keyfile": settings.ssl_keyfile or None,
    }
    server = _Server(
        uvicorn.Config(
            app.http,
            port=settings.http_port,
            lifespan="on",
            **options,  # type: ignore[arg-type]
        )
    )
    sockets = [socket.socket(fileno=settings.http_fd)] if settings.http_fd >= 0 else None
    metrics_socket = _metrics_socket(settings)
    if metrics_socket is None:
        server.run(sockets=sockets)
        return
    metrics_server = _Follower(
        uvicorn.Config(
            app.metrics,
            port=settings.metrics_port,
            lifespan="off",
            **options,  # type: ignore[arg-type]
        )
    )
    uvloop.run(_serve_both(server, sockets, metrics_server, metrics_socket))


class _Server(uvicorn.Server):
    """uvicorn's server, woken once a second (for its Date header) instead of ten times, and
    at once when asked to exit: its own loop checks ``should_exit`` every 0.1 s, which is
    most of what an idle gateway does."""

    TICK_S = 1.0

    def __init__(self, config: uvicorn.Config) -> None:
        self._exit_flag = False
        self._woken: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        super().__init__(config)

    @property
    def should_exit(self) -> bool:
        return self._exit_flag

    @should_exit.setter
    def should_exit(self, value: bool) -> None:
        self._exit_flag = value
        if value and self._loop is not None and self._woken is not None:
            # (from a signal handler or another task: wake the main loop on its own loop)
            self._loop.call_soon_threadsafe(self._woken.set)

    async def main_loop(self) -> None:
        self._loop, self._woken = asyncio.get_running_loop(), asyncio.Event()
        # uvicorn refreshes its Date header when the tick counter is a multiple of 10.
        should_exit = await self.on_tick(0)
        while not should_exit:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._woken.wait(), self.TICK_S)
            should_exit = await self.on_tick(0)


class _Follower(_Server):
    """A server that leaves the signals to the main one and stops when it stops."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def _serve_both(
    main: uvicorn.Server,
    sockets: list[socket.socket] | None,
    metrics: uvicorn.Server,
    metrics_socket: socket.socket,
) -> None:
    follower = asyncio.create_task(metrics.serve(sockets=[metrics_socket]))
    try:
        await main.serve(sockets=sockets)
    finally:
        metrics.should_exit = True
        await follower


def _metrics_socket(settings: GatewaySettings) -> socket.socket | None:
    """The metrics port's listening socket: inherited from ``sluice up``, or bound here."""
    if settings.metrics_fd >= 0:
        return socket.socket(fileno=settings.metrics_fd)
    if not settings.metrics_port:
        return None
    family = socket.AF_INET6 if ":" in settings.http_host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((settings.http_host, settings.metrics_port))
    except OSError as exc:
        listener.close()
        where = f"{settings.http_host}:{settings.metrics_port}"
        sys.exit(f"error: cannot listen on {where} (metrics port): {exc.strerror}")
    listener.listen(2048)
    return listener


if __name__ == "__main__":
    from sluice.core.logs import configure_logging

    configure_logging("gateway", GatewaySettings())
    serve(GatewaySettings())
