"""A real Sluice stack (``sluice up``) in a subprocess, on free loopback ports."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from sluice.scheduler.executor.redis_server import free_port
from tests.support import procs

READY_PREFIX = "Sluice ready at "


@dataclass
class Stack:
    """``redis_url`` None: no SLUICE_REDIS_URL, so ``sluice up`` starts its private
    redis-server; ``redis_url`` is then set to that server's URL once the stack is ready."""

    repository: Path | str
    """A local directory, or an s3:// URL."""
    redis_url: str | None
    env: dict[str, str] = field(default_factory=dict)
    namespace: str = field(default_factory=lambda: f"t{uuid.uuid4().hex[:8]}")
    port: int = field(default_factory=free_port)
    metrics_port: int = 0
    """The metrics-only port (0: none, /metrics stays on the HTTP port)."""
    grpc_port: int = field(default_factory=free_port)
    """The gRPC port (0: none)."""
    args: list[str] = field(default_factory=list)
    """More ``sluice up`` options."""
    process: subprocess.Popen[str] | None = None
    stdout_lines: list[str] = field(default_factory=list)
    stderr_lines: list[str] = field(default_factory=list)
    _readers: list[threading.Thread] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def address(self) -> str:
        """host:port, the form tritonclient takes."""
        return f"127.0.0.1:{self.port}"

    @property
    def grpc_address(self) -> str:
        """host:port of the gRPC API, the form tritonclient.grpc takes."""
        return f"127.0.0.1:{self.grpc_port}"

    def start(self, timeout_s: float = 90.0) -> None:
        """Start ``sluice up`` and wait until it is ready. A port another process took
        between :func:`free_port` and the listen (the suite runs in two streams beside
        other servers) is replaced by a new free one and the start tried again."""
        for attempt in range(3):
            try:
                self._start_once(timeout_s)
                return
            except RuntimeError as error:
                if "Address already in use" not in str(error) or attempt == 2:
                    raise
            self.port, self.grpc_port = free_port(), free_port() if self.grpc_port else 0
            if self.metrics_port:
                self.metrics_port = free_port()
            self.stdout_lines, self.stderr_lines = [], []

    def _start_once(self, timeout_s: float) -> None:
        # No batch worker, and one gateway process, unless a test asks for more
        # (SLUICE_BATCH_WORKERS, SLUICE_GATEWAY_PROCESSES in ``env``, or --gateway-processes):
        # each process started costs the suite seconds of CPU (a gateway's imports: about 2 s).
        env = dict(
            os.environ,
            SLUICE_NAMESPACE=self.namespace,
            SLUICE_BATCH_WORKERS="0",
            SLUICE_GATEWAY_PROCESSES="1",
        )
        env.pop("SLUICE_REDIS_URL", None)
        if self.redis_url is not None:
            env["SLUICE_REDIS_URL"] = self.redis_url
        env.update(self.env)
        private = self.redis_url is None
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "sluice.cli",
                "up",
                "--model-repository",
                str(self.repository),
                "--http-port",
                str(self.port),
                "--metrics-port",
                str(self.metrics_port),
                "--grpc-port",
                str(self.grpc_port),
                *self.args,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        lines: queue.Queue[str] = queue.Queue()
        self._readers = [
            threading.Thread(target=self._pump, args=(self.process.stdout, lines), daemon=True),
            threading.Thread(target=self._collect_stderr, daemon=True),
        ]
        for reader in self._readers:
            reader.start()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                line = lines.get(timeout=0.2)
            except queue.Empty:
                if self.process.poll() is not None:
                    break
                continue
            if line.startswith(READY_PREFIX):
                if private:
                    self.redis_url = self._private_redis_url()
                return
        self.stop()
        raise RuntimeError("sluice up did not become ready:\n" + "".join(self.stderr_lines[-40:]))

    def _private_redis_url(self, timeout_s: float = 5.0) -> str:
        """The private redis-server's URL, password included, as the children got it (in
        their environment: ``sluice up`` never prints the password)."""
        assert self.process is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for child in procs.children(self.process.pid):
                url = procs.environment(child).get("SLUICE_REDIS_URL")
                if url:
                    return url
            time.sleep(0.05)
        raise RuntimeError("no child of sluice up has the private redis-server's URL")

    def _pump(self, stream, lines: queue.Queue[str]) -> None:  # type: ignore[no-untyped-def]
        for line in stream:
            self.stdout_lines.append(line)
            lines.put(line)

    def _collect_stderr(self) -> None:
        assert self.process is not None and self.process.stderr is not None
        for line in self.process.stderr:
            self.stderr_lines.append(line)

    def stop(self, timeout_s: float = 30.0) -> int | None:
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        for reader in self._readers:  # everything it printed, up to its last line
            reader.join(5)
        if any(reader.is_alive() for reader in self._readers):
            # A process that outlived it (a child killed with its parent, say) still holds
            # the pipes: closing them would wait for good on the reader that reads them.
            return self.process.returncode
        for stream in (self.process.stdout, self.process.stderr):
            if stream is not None:
                stream.close()
        return self.process.returncode
