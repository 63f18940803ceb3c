"""The ports ``sluice up`` holds for its gateways: listening sockets they inherit, and the
gRPC port, reserved."""

from __future__ import annotations

import socket

from sluice.core.settings import UpSettings


class ListenError(Exception):
    """A port ``sluice up`` cannot listen on (in use, or not allowed)."""


def open_listeners(settings: UpSettings) -> list[socket.socket]:
    """The HTTP listener, then the metrics listener when there is a metrics port. They stay
    open here for as long as we run: a restarted gateway serves on them again, and
    connections arriving meanwhile wait in their backlog."""
    listeners: list[socket.socket] = []
    ports = [settings.http_port] + ([settings.metrics_port] if settings.metrics_port else [])
    for port in ports:
        try:
            listeners.append(_listen(settings.http_host, port))
        except OSError as exc:
            for listener in listeners:
                listener.close()
            where = f"{settings.http_host}:{port}"
            raise ListenError(f"cannot listen on {where}: {exc.strerror}") from None
    return listeners


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
