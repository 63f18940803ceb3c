"""A real Redis Cluster of the tests' own: redis-server processes in cluster mode on free
loopback ports, joined by ``redis-cli --cluster create`` (primaries with one replica each).

Fault tests stop a primary (SIGKILL) and watch its replica take over; ``stop`` kills
everything and removes the nodes' files.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from redis import Redis
from redis.exceptions import RedisError

NODE_TIMEOUT_MS = 1500
"""How long a primary may be silent before its replica is promoted (cluster-node-timeout)."""


class NoPrimary(RuntimeError):
    pass


def _free_cluster_port() -> int:
    """A port that is free, and whose cluster bus port (port + 10000) is free too."""
    for _ in range(200):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port: int = sock.getsockname()[1]
        if port + 10000 > 65535:
            continue
        with socket.socket() as bus:
            try:
                bus.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port pair for a Redis Cluster node")


@dataclass
class ClusterNode:
    port: int
    process: subprocess.Popen[bytes] | None = None

    def client(self, timeout_s: float = 1.0) -> Redis:
        return Redis(
            host="127.0.0.1", port=self.port, socket_timeout=timeout_s, socket_connect_timeout=1
        )

    def role(self) -> str:
        info = self.client().info("replication")
        return str(info.get("role", ""))


@dataclass
class LocalRedisCluster:
    primaries: int = 3
    replicas: int = 1
    nodes: list[ClusterNode] = field(default_factory=list)
    workdir: Path = field(
        default_factory=lambda: Path(tempfile.mkdtemp(prefix="sluice-redis-cluster-"))
    )

    @property
    def url(self) -> str:
        """What SLUICE_REDIS_URL names: any node, with the cluster scheme."""
        return f"redis+cluster://127.0.0.1:{self.nodes[0].port}"

    def start(self, timeout_s: float = 30.0) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
        for _ in range(self.primaries * (1 + self.replicas)):
            node = ClusterNode(_free_cluster_port())
            node.process = self._launch(binary, node.port)
            self.nodes.append(node)
        deadline = time.monotonic() + timeout_s
        for node in self.nodes:
            self._wait(lambda node=node: bool(node.client().ping()), deadline, "a node to start")
        addresses = [f"127.0.0.1:{node.port}" for node in self.nodes]
        subprocess.run(
            [
                "redis-cli",
                "--cluster",
                "create",
                *addresses,
                "--cluster-replicas",
                str(self.replicas),
                "--cluster-yes",
            ],
            check=True,
            capture_output=True,
            timeout=timeout_s,
        )
        self.wait_healthy(deadline - time.monotonic())
        self.wait_replicas_synced(deadline - time.monotonic())

    def wait_replicas_synced(self, timeout_s: float = 30.0) -> None:
        """Until every replica has its primary's data (its link is up): a replica that never
        synced cannot be promoted when its primary dies."""
        deadline = time.monotonic() + timeout_s

        def synced() -> bool:
            for node in self.running():
                info = node.client().info("replication")
                if info.get("role") == "slave" and info.get("master_link_status") != "up":
                    return False
            return True

        self._wait(synced, deadline, "every replica to sync with its primary")

    def _launch(self, binary: str, port: int) -> subprocess.Popen[bytes]:
        folder = self.workdir / str(port)
        folder.mkdir(parents=True, exist_ok=True)
        return subprocess.Popen(
            [
                binary,
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                "nodes.conf",
                "--cluster-node-timeout",
                str(NODE_TIMEOUT_MS),
                # A replica's first full sync starts at once, not after the default 5 s
                # wait for more replicas: until it ends, the replica cannot take over.
                "--repl-diskless-sync-delay",
                "0",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(folder),
                "--loglevel",
                "warning",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    def wait_healthy(self, timeout_s: float = 30.0) -> None:
        """Until every running node says the cluster is ok and every slot is served."""
        deadline = time.monotonic() + timeout_s

        def healthy() -> bool:
            for node in self.running():
                info = node.client().execute_command("CLUSTER INFO")
                if isinstance(info, bytes):
                    info = dict(line.split(":", 1) for line in info.decode().split() if ":" in line)
                if str(info.get("cluster_state")) != "ok":
                    return False
                if int(info.get("cluster_slots_ok", 0)) != 16384:
                    return False
            return True

        self._wait(healthy, deadline, "the cluster to be ok")

    def running(self) -> list[ClusterNode]:
        return [n for n in self.nodes if n.process is not None and n.process.poll() is None]

    def primary_nodes(self) -> list[ClusterNode]:
        return [n for n in self.running() if n.role() == "master"]

    def primary_of(self, key: str) -> ClusterNode:
        """The running primary that serves ``key``'s slot now."""
        slot = int(self.running()[0].client().execute_command("CLUSTER KEYSLOT", key))
        for node in self.primary_nodes():
            for entry in node.client().execute_command("CLUSTER SLOTS"):
                low, high, owner = int(entry[0]), int(entry[1]), entry[2]
                if low <= slot <= high and int(owner[1]) == node.port:
                    return node
        raise NoPrimary(f"no primary serves slot {slot}")

    def wait_promoted(self, key: str, timeout_s: float = 30.0) -> ClusterNode:
        """Until a running primary serves ``key``'s slot (after its primary was killed: the
        replica's promotion) and the cluster is ok again; that primary."""
        deadline = time.monotonic() + timeout_s
        self._wait(lambda: self.primary_of(key), deadline, f"a primary for '{key}'")
        self.wait_healthy(deadline - time.monotonic())
        return self.primary_of(key)

    def kill(self, node: ClusterNode) -> None:
        if node.process is not None and node.process.poll() is None:
            node.process.send_signal(signal.SIGKILL)
            node.process.wait(5)

    def stop(self) -> None:
        for node in self.nodes:
            self.kill(node)
        shutil.rmtree(self.workdir, ignore_errors=True)

    @staticmethod
    def _wait(check: object, deadline: float, what: str) -> None:
        last: Exception | None = None
        while time.monotonic() < deadline:
            try:
                if check():  # type: ignore[operator]
                    return
            except (RedisError, OSError, NoPrimary) as exc:
                last = exc
            time.sleep(0.1)
        raise TimeoutError(f"timed out waiting for {what} (last error: {last})")
