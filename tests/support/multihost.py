"""A Sluice deployment spread over test hosts (:mod:`tests.support.netns`).

The layout of "Several hosts" (docs/operations/several-hosts.md): Redis alone on one host,
gateways on hosts with a front link (clients) and a back link (Redis, workers), and worker
hosts on the back network, each running ``sluice up --no-gateway --no-controller`` against
the shared Redis with its own host id. The test process joins both networks: it is the
clients on the front, and reads Redis on the back the way an operator would.

Every process writes its output to a log file; :meth:`Deployment.logs` gives their tails
for a failing test's message.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, cast

import httpx
from redis import Redis

from sluice.core.keys import Keys
from tests.support.netns import Host, HostNetwork, NetnsUnavailable

REDIS_PORT = 6379
HTTP_PORT = 8000
SLUICE = (sys.executable, "-m", "sluice.cli")


@dataclass
class HostProcess:
    """One process on a test host, with its output in ``log_path``."""

    name: str
    host: Host
    process: subprocess.Popen[bytes]
    log_path: Path
    _log: IO[bytes]

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, timeout_s: float = 20.0) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()

    def tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


@dataclass
class Deployment:
    """Redis, gateways and worker hosts on ``network``; :meth:`start`, then :meth:`stop`."""

    network: HostNetwork
    repository: Path
    logs_dir: Path
    gateways: int = 1
    worker_hosts: int = 2
    env: dict[str, str] = field(default_factory=dict)
    """Extra SLUICE_* settings for every Sluice process."""
    namespace: str = field(default_factory=lambda: f"t{uuid.uuid4().hex[:8]}")
    processes: list[HostProcess] = field(default_factory=list)
    gateway_hosts: list[Host] = field(default_factory=list)
    worker_host_list: list[Host] = field(default_factory=list)
    redis_host: Host | None = None
    redis: Redis | None = None
    """A client of the test process on the shared Redis (over its back link)."""

    @property
    def keys(self) -> Keys:
        return Keys(self.namespace)

    @property
    def redis_url(self) -> str:
        assert self.redis_host is not None
        return f"redis://{self.redis_host.address('back')}:{REDIS_PORT}/0"

    def gateway_url(self, index: int = 0) -> str:
        return f"http://{self.gateway_hosts[index].address('front')}:{HTTP_PORT}"

    def start(self, timeout_s: float = 120.0) -> None:
        net = self.network
        net.join("front")
        net.join("back")
        self.redis_host = net.add_host("redis", ["back"])
        self.gateway_hosts = [
            net.add_host(f"gw{n}", ["front", "back"]) for n in range(self.gateways)
        ]
        self.worker_host_list = [net.add_host(f"wk{n}", ["back"]) for n in range(self.worker_hosts)]
        redis_host = self.redis_host
        redis_args = f"--port {REDIS_PORT} --save '' --appendonly no --protected-mode no "
        redis_args += "--loglevel warning"
        self._spawn(
            "redis",
            redis_host,
            ["redis-server", "--bind", redis_host.address("back"), *shlex.split(redis_args)],
        )
        self.redis = Redis.from_url(self.redis_url, socket_timeout=5, socket_connect_timeout=2)
        self._wait("redis-server answering", self._redis_answers, 10)
        workers = [
            *["up", "--no-gateway", "--no-controller", "--model-repository"],
            str(self.repository),
        ]
        gateway = f"gateway --http-host 0.0.0.0 --http-port {HTTP_PORT} --grpc-port 0".split()
        for host in self.worker_host_list:
            self._spawn(host.name, host, [*SLUICE, *workers])
        for host in self.gateway_hosts:
            self._spawn(host.name, host, [*SLUICE, *gateway])
        deadline = time.monotonic() + timeout_s
        for index in range(self.gateways):
            self._wait(
                f"gateway {index} ready",
                lambda i=index: self._gateway_ready(i),
                deadline - time.monotonic(),
            )

    def _env(self, host: Host) -> dict[str, str]:
        env = dict(os.environ)
        for name in list(env):
            if name.startswith("SLUICE_"):
                del env[name]
        env.update(
            SLUICE_REDIS_URL=self.redis_url,
            SLUICE_NAMESPACE=self.namespace,
            SLUICE_HOST_ID=host.name,
            SLUICE_BATCH_WORKERS="0",
            **self.env,
        )
        return env

    def _spawn(self, name: str, host: Host, argv: Sequence[str]) -> HostProcess:
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.logs_dir / f"{name}.log"
        log = log_path.open("ab")
        process = host.popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env=self._env(host), cwd=os.getcwd()
        )
        child = HostProcess(name, host, process, log_path, log)
        self.processes.append(child)
        return child

    def _wait(self, what: str, predicate: Any, timeout_s: float) -> None:
        deadline = time.monotonic() + max(timeout_s, 0.0)
        while time.monotonic() < deadline:
            if predicate():
                return
            dead = [p.name for p in self.processes if not p.alive()]
            if dead:
                raise RuntimeError(
                    f"{', '.join(dead)} exited while waiting for {what}:\n" + self.logs()
                )
            time.sleep(0.2)
        raise RuntimeError(f"not within {timeout_s:.0f} s: {what}\n" + self.logs())

    def _redis_answers(self) -> bool:
        assert self.redis is not None
        try:
            return bool(self.redis.ping())
        except Exception:
            return False

    def _gateway_ready(self, index: int) -> bool:
        try:
            return (
                httpx.get(f"{self.gateway_url(index)}/v2/health/ready", timeout=2).status_code
                == 200
            )
        except httpx.HTTPError:
            return False

    def workers_by_host(self, model: str, version: int = 1) -> dict[str, set[str]]:
        """Host id -> the ids of that host's live workers of ``model``, as Redis sees them."""
        assert self.redis is not None
        keys = self.keys
        members = self.redis.zrangebyscore(
            keys.live_workers(model, version), self.redis_time(), "+inf"
        )
        live = {member.decode() for member in cast(list[bytes], members)}
        hosts: dict[str, set[str]] = {}
        advertised = cast(dict[bytes, bytes], self.redis.hgetall(keys.worker_hosts(model, version)))
        for worker, host in advertised.items():
            if worker.decode() in live:
                hosts.setdefault(host.decode(), set()).add(worker.decode())
        return hosts

    def wait_for_workers(self, model: str, per_host: int, timeout_s: float = 90.0) -> None:
        """Until every worker host has ``per_host`` live workers of ``model``."""
        names = [h.name for h in self.worker_host_list]

        def enough() -> bool:
            found = self.workers_by_host(model)
            return all(len(found.get(name, ())) >= per_host for name in names)

        self._wait(f"{per_host} live worker(s) of '{model}' on each of {names}", enough, timeout_s)

    def redis_time(self) -> float:
        assert self.redis is not None
        seconds, micros = self.redis.time()
        return seconds + micros / 1e6

    def logs(self, lines: int = 30) -> str:
        return "\n".join(f"--- {p.name}\n{p.tail(lines)}" for p in self.processes)

    def stop(self) -> None:
        """Stop every process (links are restored first, so that they can stop cleanly)."""
        for host in [*self.gateway_hosts, *self.worker_host_list]:
            for network in host.ports:
                with contextlib.suppress(NetnsUnavailable):
                    self.network.restore(host, network)
        for child in reversed(self.processes):
            child.stop()
        if self.redis is not None:
            self.redis.close()
