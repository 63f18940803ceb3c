"""A private redis-server for ``sluice up`` when no SLUICE_REDIS_URL is given.

``sluice up`` supervises it: when it dies it is started again on the same port, empty
(it keeps nothing on disk); the catalog is published again and the gateway and the
workers reconnect by themselves (see CatalogKeeper in :mod:`.catalog_keeper`).

Any local user can connect to a port on 127.0.0.1, and whoever reaches Redis can read and
rewrite every request, answer and job: ``sluice up`` gives its redis-server a password made
for that start (:func:`new_password`). The password is written to a configuration file
that only this user can read, never to redis-server's arguments (which every local user
sees in the process list); the children get it in ``SLUICE_REDIS_URL``, in their
environment. ``maxmemory`` with ``noeviction`` bounds its memory: once full, writes are
refused (the gateway answers 503) instead of queued entries being evicted.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from redis import Redis
from redis.exceptions import RedisError

from sluice.core.runtime import die_with_parent
from sluice.scheduler.executor.supervisor import Backoff

log = logging.getLogger(__name__)

INSTALL_HINT = (
    "redis-server was not found on PATH. Install it "
    "(Debian/Ubuntu: 'apt-get install redis-server', macOS: 'brew install redis') "
    "or point Sluice at a running Redis with SLUICE_REDIS_URL=redis://host:port/0"
)


class RedisNotInstalled(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def new_password() -> str:
    """256 random bits, in hex (safe in a URL, a configuration file and a shell)."""
    return secrets.token_hex(32)


@dataclass
class RedisServer:
    """A redis-server child on loopback that keeps nothing on disk; with ``password`` it
    refuses every client that does not authenticate, with ``maxmemory_bytes`` it refuses
    writes beyond that size."""

    port: int = 0
    password: str = field(default="", repr=False)
    """Empty: none (the test suite's own servers); the same across restarts."""
    maxmemory_bytes: int = 0
    """0: no limit."""
    process: subprocess.Popen[bytes] | None = None
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="sluice-redis-")))
    backoff: Backoff = field(default_factory=Backoff)
    started_at: float = 0.0
    restart_at: float | None = None
    """When it exited: when to start it again."""

    @property
    def url(self) -> str:
        """The URL clients use, with the password: for children's environment only."""
        credentials = f":{self.password}@" if self.password else ""
        return f"redis://{credentials}127.0.0.1:{self.port}/0"

    @property
    def address(self) -> str:
        """Where it listens, without the password: for logs."""
        return f"127.0.0.1:{self.port}"

    def _write_config(self) -> Path:
        """The configuration file, readable by this user only (the directory is too)."""
        lines = [
            f"port {self.port}",
            "bind 127.0.0.1",
            "protected-mode yes",
            'save ""',
            "appendonly no",
            f'dir "{self.workdir}"',
            "loglevel warning",
            # Its background tasks twice a second instead of ten times: an idle
            # deployment's Redis then costs a quarter as much CPU. Blocking reads still end
            # on time (Redis keeps a timer for them), expired keys go at the same rate, and
            # dynamic-hz (on by default) raises the pace with many clients.
            "hz 2",
        ]
        if self.password:
            lines.append(f"requirepass {self.password}")
        if self.maxmemory_bytes:
            lines += [f"maxmemory {self.maxmemory_bytes}", "maxmemory-policy noeviction"]
        path = self.workdir / "redis.conf"
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(descriptor, "w") as config:
            config.write("\n".join(lines) + "\n")
        return path

    def start(self, timeout_s: float = 10.0) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RedisNotInstalled(INSTALL_HINT)
        self.port = self.port or free_port()
        self.workdir.chmod(0o700)
        self.process = subprocess.Popen(
            [binary, str(self._write_config())],
            stdout=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
        self.started_at = time.monotonic()
        deadline = time.monotonic() + timeout_s
        client = Redis.from_url(self.url, socket_connect_timeout=0.5)
        try:
            while True:
                try:
                    client.ping()
                    return
                except RedisError:
                    if self.process.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(
                            f"redis-server did not start on {self.address}"
                        ) from None
                    time.sleep(0.05)
        finally:
            client.close()

    def tick(self) -> None:
        """Start redis-server again on its port if it exited; call periodically."""
        if self.process is None:
            return
        now = time.monotonic()
        if self.restart_at is None:
            code = self.process.poll()
            if code is None:
                return
            delay = self.backoff.delay_after(now - self.started_at)
            self.restart_at = now + delay
            log.warning(
                "redis-server exited with status %d; restarting it on port %d%s",
                code,
                self.port,
                f" in {delay:.1f} s" if delay else "",
            )
        if now >= self.restart_at:
            self.restart_at = None
            try:
                self.start()
            except RuntimeError as exc:  # it exited again: the next tick backs off
                log.error("%s", exc)
            else:
                log.info("redis-server is back at %s", self.address)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self.workdir, ignore_errors=True)
