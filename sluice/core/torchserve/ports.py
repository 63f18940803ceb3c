"""Where TorchServe's three APIs listen: ``SLUICE_TORCHSERVE_PORTS``, TorchServe's
``config.properties`` addresses, or ``sluice up --torchserve``.

The setting names the inference, management and metrics ports in that order, comma-separated
(``8080,8081,8082``, TorchServe's own); each may be ``host:port`` (``[::1]:8080`` for IPv6),
and ``0`` (or nothing) leaves that API out. A port without a host listens on the gateway's
HTTP address."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

API_NAMES = ("inference", "management", "metrics")
TORCHSERVE_DEFAULT = "8080,8081,8082"
"""TorchServe's own ports: ``sluice up --torchserve``."""
ADDRESS_KEYS = ("inference_address", "management_address", "metrics_address")
"""The keys of TorchServe's ``config.properties`` that say where its APIs listen."""


@dataclass(frozen=True)
class Listen:
    host: str
    """Empty: the gateway's HTTP address."""
    port: int


def parse_ports(text: str) -> tuple[Listen | None, Listen | None, Listen | None]:
    """The inference, management and metrics listeners ``text`` names; ValueError names the
    entry that is wrong."""
    if not text.strip():
        return (None, None, None)
    entries = [entry.strip() for entry in text.split(",")]
    if len(entries) > len(API_NAMES):
        raise ValueError(
            f"{text!r}: at most three entries (inference, management, metrics ports), "
            f"got {len(entries)}"
        )
    entries += [""] * (len(API_NAMES) - len(entries))
    found = [_listen(name, entry) for name, entry in zip(API_NAMES, entries, strict=True)]
    ports = [listen.port for listen in found if listen is not None]
    if len(set(ports)) != len(ports):
        raise ValueError(f"{text!r}: each API needs a port of its own")
    return (found[0], found[1], found[2])


def _listen(name: str, entry: str) -> Listen | None:
    if entry in ("", "0"):
        return None
    host, sep, port_text = entry.rpartition(":")
    if not sep:
        host, port_text = "", entry
    host = host.removeprefix("[").removesuffix("]")
    if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise ValueError(f"the {name} port {entry!r} is not a port number from 1 to 65535")
    return Listen(host, int(port_text))


def from_properties(properties: dict[str, str]) -> str:
    """The setting's value from TorchServe's ``inference_address``, ``management_address``
    and ``metrics_address`` (``http://host:port``), for the APIs they name ("" when none)."""
    entries: list[str] = []
    for key in ADDRESS_KEYS:
        address = properties.get(key, "").strip()
        if not address:
            entries.append("0")
            continue
        parts = urlsplit(address if "://" in address else f"http://{address}")
        if parts.scheme != "http":
            raise ValueError(
                f"config.properties: {key}={address}: Sluice serves TorchServe's APIs over "
                "plain HTTP (put TLS in front of them, or use Sluice's own HTTPS port)"
            )
        if parts.port is None or not parts.hostname:
            raise ValueError(f"config.properties: {key}={address}: needs a host and a port")
        host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
        entries.append(f"{host}:{parts.port}")
    return "" if entries == ["0"] * len(ADDRESS_KEYS) else ",".join(entries)
