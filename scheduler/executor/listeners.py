"""The ports ``sluice up`` holds for its gateways: listening sockets they inherit (HTTP,
metrics, TorchServe's), and the gRPC port, reserved."""

from __future__ import annotations

import socket
from dataclasses import dataclass

from sluice.core.settings import UpSettings
from sluice.core.torchserve.ports import API_NAMES, parse_ports


class ListenError(Exception):
    """A port ``sluice up`` cannot listen on (in use, or not allowed)."""


@dataclass
class Listeners:
    """The listening sockets the gateways inherit."""

    http: socket.socket
    metrics: socket.socket | None = None
    torchserve: tuple[socket.socket | None, ...] = (None, None, None)
    """TorchServe's inference, management and metrics ports, each when served."""

    def all(self) -> list[socket.socket]:
        found = [self.http, self.metrics, *self.torchserve]
        return [listener for listener in found if listener is not None]


def open_listeners(settings: UpSettings) -> Listeners:
    """The HTTP listener, the metrics listener when there is a metrics port, and TorchServe's
    when asked for. They stay open here for as long as we run: a restarted gateway serves on
    them again, and connections arriving meanwhile wait in their backlog."""
    opened: list[socket.socket] = []

    def listen(host: str, port: int, what: str) -> socket.socket:
        try:
            listener = _listen(host, port)
        except OSError as exc:
            for done in opened:
                done.close()
            raise ListenError(f"cannot listen on {host}:{port}{what}: {exc.strerror}") from None
        opened.append(listener)
        return listener

    host = settings.http_host
    http = listen(host, settings.http_port, "")
    metrics = (
        listen(host, settings.metrics_port, " (metrics port)") if settings.metrics_port else None
    )
    torchserve = tuple(
        None
        if entry is None
        else listen(entry.host or host, entry.port, f" (TorchServe's {name} port)")
        for name, entry in zip(API_NAMES, parse_ports(settings.torchserve_ports), strict=True)
    )
    return Listeners(http, metrics, torchserve)


def reserve_grpc_port(settings: UpSettings) -> socket.socket | None:
    """Hold the gRPC port for our gateways, which bind it with SO_REUSEPORT (grpcio cannot
    serve on an inherited socket): bound, never listening, so no connection lands here.
    Checked first without SO_REUSEPORT, so that a port another server holds (another Sluice
    included) is refused instead of shared."""
    if not settings.grpc_port:
        return None
    family = socket.AF_INET6 if ":" in settings.http_host else socket.AF_INET
    where = f"{settings.http_host}:{settings.grpc_port}"
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((settings.http_host, settings.grpc_port))
        reserved = socket.socket(family, socket.SOCK_STREAM)
        reserved.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        reserved.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        reserved.bind((settings.http_host, settings.grpc_port))
    except OSError as exc:
        raise ListenError(f"cannot listen on {where} (gRPC port): {exc.strerror}") from None
    return reserved


def _listen(host: str, port: int) -> socket.socket:
    """One listening socket shared by every gateway process: the kernel spreads connections."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host, port))
    listener.listen(2048)
    listener.set_inheritable(True)
    return listener
