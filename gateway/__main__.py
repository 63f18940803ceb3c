"""``python -m sluice.gateway``: one gateway process under uvicorn (uvloop, httptools)."""

from __future__ import annotations

import asyncio
import contextlib
import resource
import socket
import sys
from collections.abc import Iterator, Sequence

import uvicorn
import uvloop
from starlette.types import ASGIApp

from sluice.core.runtime import tune_garbage_collector
from sluice.core.settings import GatewaySettings, settings_at_start
from sluice.core.torchserve.ports import API_NAMES, parse_ports
from sluice.gateway.app import GatewayApp, create_app
from sluice.gateway.http.protocol import bounded_protocol


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
        ),
        exiting=app.exiting,
    )
    sockets = [socket.socket(fileno=settings.http_fd)] if settings.http_fd >= 0 else None
    followers = [
        (
            _Follower(uvicorn.Config(follower_app, port=port, lifespan="off", **options)),  # type: ignore[arg-type]
            listener,
        )
        for follower_app, port, listener in _followers(settings, app)
    ]
    if not followers:
        server.run(sockets=sockets)
        return
    uvloop.run(_serve_all(server, sockets, followers))


def _followers(
    settings: GatewaySettings, app: GatewayApp
) -> list[tuple[ASGIApp, int, socket.socket]]:
    """The ports served beside the HTTP port: the metrics port and TorchServe's, each with
    its application and listening socket."""
    found: list[tuple[ASGIApp, int, socket.socket]] = []
    metrics = _socket(
        settings.metrics_fd, settings.http_host, settings.metrics_port, "metrics port"
    )
    if metrics is not None:
        found.append((app.metrics, settings.metrics_port, metrics))
    torchserve_apps = (app.torchserve_inference, app.torchserve_management, app.torchserve_metrics)
    fds = [int(fd) for fd in settings.torchserve_fds.split(",") if fd.strip()]
    entries = parse_ports(settings.torchserve_ports)
    for index, (name, entry) in enumerate(zip(API_NAMES, entries, strict=True)):
        if entry is None:
            continue
        fd = fds[index] if index < len(fds) else -1
        what = f"TorchServe's {name} port"
        listener = _socket(fd, entry.host or settings.http_host, entry.port, what)
        if listener is not None:
            found.append((torchserve_apps[index], entry.port, listener))
    return found


class _Server(uvicorn.Server):
    """uvicorn's server, woken once a second (for its Date header) instead of ten times, and
    at once when asked to exit: its own loop checks ``should_exit`` every 0.1 s, which is
    most of what an idle gateway does."""

    TICK_S: float | None = 1.0
    """None: no tick of its own (a follower, ticked by the main server)."""

    def __init__(self, config: uvicorn.Config, exiting: asyncio.Event | None = None) -> None:
        self._exit_flag = False
        self._exiting = exiting
        """Set once this server stops taking connections, before it drains them."""
        self._woken: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.followers: list[_Server] = []
        """Servers of the same process ticked with this one, so that one timer wakes it."""
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
            if self.TICK_S is None:
                await self._woken.wait()
            else:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._woken.wait(), self.TICK_S)
                for follower in self.followers:
                    if follower.started:  # (its Date header)
                        await follower.on_tick(0)
            should_exit = await self.on_tick(0)
        if self._exiting is not None:
            self._exiting.set()


class _Follower(_Server):
    """A server that leaves the signals to the main one and stops when it stops; the main
    one ticks it."""

    TICK_S = None

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def _serve_all(
    main: _Server,
    sockets: list[socket.socket] | None,
    followers: Sequence[tuple[_Server, socket.socket]],
) -> None:
    main.followers = [server for server, _ in followers]
    running = [
        asyncio.create_task(server.serve(sockets=[listener])) for server, listener in followers
    ]
    try:
        await main.serve(sockets=sockets)
    finally:
        for server, _ in followers:
            server.should_exit = True
        await asyncio.gather(*running)


def _socket(fd: int, host: str, port: int, what: str) -> socket.socket | None:
    """A follower port's listening socket: inherited from ``sluice up``, or bound here."""
    if fd >= 0:
        return socket.socket(fileno=fd)
    if not port:
        return None
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((host, port))
    except OSError as exc:
        listener.close()
        sys.exit(f"error: cannot listen on {host}:{port} ({what}): {exc.strerror}")
    listener.listen(2048)
    return listener


if __name__ == "__main__":
    from sluice.core.observability.logs import configure_logging

    settings = settings_at_start(GatewaySettings)
    configure_logging("gateway", settings)
    serve(settings)
