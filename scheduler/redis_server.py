"""A private redis-server for ``sluice up`` when no SLUICE_REDIS_URL is given.

``sluice up`` supervises it: when it dies it is started again on the same port, empty
(it keeps nothing on disk); the catalog is published again and the gateway and the
workers reconnect by themselves (see CatalogKeeper in :mod:`scheduler.up`).
"""

from __future__ import annotations

import logging
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from redis import Redis
from redis.exceptions import RedisError

from scheduler.supervisor import Backoff, die_with_parent

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


@dataclass
class RedisServer:
    """A redis-server child on loopback that keeps nothing on disk."""

    port: int = 0
    process: subprocess.Popen[bytes] | None = None
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="sluice-redis-")))
    backoff: Backoff = field(default_factory=Backoff)
    started_at: float = 0.0
    restart_at: float | None = None
    """When it exited: when to start it again."""

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RedisNotInstalled(INSTALL_HINT)
        self.port = self.port or free_port()
        self.process = subprocess.Popen(
            [
                binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.workdir),
                "--loglevel",
                "warning",
            ],
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
                            f"redis-server did not start on port {self.port}"
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
                log.info("redis-server is back at %s", self.url)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self.workdir, ignore_errors=True)
