"""Test hosts on one machine: network namespaces joined by veth links to switched networks.

Each network is a Linux bridge inside a namespace of its own (the switch); each test host
is a namespace with one veth link per network it joins, named after that network
(``front``, ``back``), and an address on it. The test process itself can join a network
too (a veth in its own namespace), so it reaches the hosts as a client would.

Cutting a link detaches its switch port from the bridge: both ends stay up, and what
crosses the link vanishes without a word to either side, as when a cable or a switch
between two machines fails. Nothing is refused or reset, so the processes on either side
learn of it only from their own timeouts. Restoring the link attaches the port again.

Everything is named ``sl<tag>…`` and removed by :meth:`HostNetwork.close` (deleting a
namespace removes its links). Needs root and iproute2's ``ip``.
"""

from __future__ import annotations

import ipaddress
import os
import random
import shutil
import subprocess
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

_IP = "ip"


class NetnsUnavailable(RuntimeError):
    """The machine cannot make test hosts (not root, or no iproute2)."""


def unavailable_reason() -> str | None:
    """Why test hosts cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root (run the suite as root, as CI does)"
    if shutil.which(_IP) is None:
        return "iproute2's 'ip' is missing (apt-get install iproute2)"
    return None


def _run(*argv: str) -> None:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if result.returncode != 0:
        raise NetnsUnavailable(f"{' '.join(argv)}: {result.stderr.strip() or result.returncode}")


def _used_prefixes() -> list[ipaddress.IPv4Network]:
    out = subprocess.run(
        [_IP, "-4", "route", "show", "table", "all"], capture_output=True, text=True, timeout=10
    ).stdout
    found = []
    for line in out.splitlines():
        word = line.split()[0] if line.split() else ""
        if word in ("local", "broadcast", "unreachable", "blackhole", "prohibit"):
            word = line.split()[1]
        try:
            network = ipaddress.ip_network(word, strict=False)
            if isinstance(network, ipaddress.IPv4Network):
                found.append(network)
        except ValueError:
            continue
    return found


def _free_subnet(taken: list[ipaddress.IPv4Network]) -> ipaddress.IPv4Network:
    """A /24 in 10.0.0.0/8 that no route of this machine (nor another test network) uses."""
    for _ in range(200):
        candidate = ipaddress.IPv4Network(
            f"10.{random.randint(64, 250)}.{random.randint(0, 255)}.0/24"
        )
        if not any(candidate.overlaps(other) for other in taken):
            taken.append(candidate)
            return candidate
    raise NetnsUnavailable("no free 10.x.y.0/24 subnet for a test network")


@dataclass
class _Lan:
    name: str
    subnet: ipaddress.IPv4Network
    next_host: int = 2
    """The next host address (.1 is the test process's, when it joins)."""

    def address(self) -> str:
        host = str(self.subnet.network_address + self.next_host)
        self.next_host += 1
        return host


@dataclass
class Host:
    """One test host: a network namespace with an address on each network it joined."""

    name: str
    netns: str
    addresses: dict[str, str] = field(default_factory=dict)
    """Network name -> this host's address on it."""
    ports: dict[str, str] = field(default_factory=dict)
    """Network name -> the switch's port (interface in the switch namespace) of its link."""

    def address(self, network: str) -> str:
        return self.addresses[network]

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside this host (``ip netns exec`` execs it: same pid)."""
        return [_IP, "netns", "exec", self.netns, *argv]

    def popen(self, argv: Sequence[str], **options: Any) -> subprocess.Popen[Any]:
        return subprocess.Popen(self.command(argv), **options)


class HostNetwork:
    """Switched networks and the test hosts on them; a context manager that removes all."""

    def __init__(self, networks: Sequence[str] = ("front", "back")) -> None:
        reason = unavailable_reason()
        if reason is not None:
            raise NetnsUnavailable(reason)
        self.tag = uuid.uuid4().hex[:5]
        self.switch = f"sl{self.tag}sw"
        self.hosts: dict[str, Host] = {}
        self.networks: dict[str, _Lan] = {}
        self._namespaces: list[str] = []
        self._root_links: list[str] = []
        self._ports = 0
        try:
            self._add_namespace(self.switch)
            taken = _used_prefixes()
            for name in networks:
                self.networks[name] = _Lan(name, _free_subnet(taken))
                bridge = self._bridge(name)
                _run(_IP, "-n", self.switch, "link", "add", "name", bridge, "type", "bridge")
                _run(_IP, "-n", self.switch, "link", "set", "dev", bridge, "up")
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> HostNetwork:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    @staticmethod
    def _bridge(network: str) -> str:
        return f"br-{network}"[:15]

    def _add_namespace(self, name: str) -> None:
        _run(_IP, "netns", "add", name)
        self._namespaces.append(name)
        _run(_IP, "-n", name, "link", "set", "dev", "lo", "up")

    def _port(self) -> str:
        self._ports += 1
        return f"p{self._ports}"

    def _plug(self, network: str, port: str) -> None:
        _run(_IP, "-n", self.switch, "link", "set", "dev", port, "master", self._bridge(network))
        _run(_IP, "-n", self.switch, "link", "set", "dev", port, "up")

    def add_host(self, name: str, networks: Sequence[str] = ("back",)) -> Host:
        """A new test host with one link to each of ``networks``."""
        host = Host(name, f"sl{self.tag}{name}"[:40])
        self._add_namespace(host.netns)
        for network in networks:
            port = self._port()
            _run(
                _IP, "link", "add", "name", f"sl{self.tag}tmp", "netns", host.netns,
                "type", "veth", "peer", "name", port, "netns", self.switch,
            )  # fmt: skip
            _run(_IP, "-n", host.netns, "link", "set", "dev", f"sl{self.tag}tmp", "name", network)
            address = self.networks[network].address()
            prefix = self.networks[network].subnet.prefixlen
            _run(_IP, "-n", host.netns, "addr", "add", f"{address}/{prefix}", "dev", network)
            _run(_IP, "-n", host.netns, "link", "set", "dev", network, "up")
            self._plug(network, port)
            host.addresses[network] = address
            host.ports[network] = port
        self.hosts[name] = host
        return host

    def join(self, network: str) -> str:
        """Give the test process itself a link to ``network``; its address there."""
        link = f"sl{self.tag}{network}"[:15]
        port = self._port()
        _run(_IP, "link", "add", "name", link, "type", "veth", "peer", "name", port,
             "netns", self.switch)  # fmt: skip
        self._root_links.append(link)
        subnet = self.networks[network].subnet
        address = str(subnet.network_address + 1)
        _run(_IP, "addr", "add", f"{address}/{subnet.prefixlen}", "dev", link)
        _run(_IP, "link", "set", "dev", link, "up")
        self._plug(network, port)
        return address

    def cut(self, host: Host, network: str) -> None:
        """Cut ``host``'s link to ``network``: from now on its packets vanish silently."""
        _run(_IP, "-n", self.switch, "link", "set", "dev", host.ports[network], "nomaster")

    def restore(self, host: Host, network: str) -> None:
        """Reconnect a link cut by :meth:`cut`."""
        self._plug(network, host.ports[network])

    def close(self) -> None:
        """Remove every namespace and link made here (their processes are the caller's)."""
        errors = []
        for link in self._root_links:
            subprocess.run([_IP, "link", "del", "dev", link], capture_output=True, timeout=10)
        for name in reversed(self._namespaces):
            result = subprocess.run(
                [_IP, "netns", "del", name], capture_output=True, text=True, timeout=10
            )
            if result.returncode != 0:
                errors.append(f"{name}: {result.stderr.strip()}")
        self._namespaces.clear()
        self._root_links.clear()
        if errors:
            raise NetnsUnavailable("removing test hosts failed: " + "; ".join(errors))
