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

from scheduler.redis_server import free_port

READY_PREFIX = "Sluice ready at "


@dataclass
class Stack:
    repository: Path
    redis_url: str
    env: dict[str, str] = field(default_factory=dict)
    namespace: str = field(default_factory=lambda: f"t{uuid.uuid4().hex[:8]}")
    port: int = field(default_factory=free_port)
    process: subprocess.Popen[str] | None = None
    stderr_lines: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def address(self) -> str:
        """host:port, the form tritonclient takes."""
        return f"127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 90.0) -> None:
        env = dict(os.environ, SLUICE_REDIS_URL=self.redis_url, SLUICE_NAMESPACE=self.namespace)
        env.update(self.env)
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
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, args=(self.process.stdout, lines), daemon=True).start()
        threading.Thread(target=self._collect_stderr, daemon=True).start()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                line = lines.get(timeout=0.2)
            except queue.Empty:
                if self.process.poll() is not None:
                    break
                continue
            if line.startswith(READY_PREFIX):
                return
        self.stop()
        raise RuntimeError("sluice up did not become ready:\n" + "".join(self.stderr_lines[-40:]))

    @staticmethod
    def _pump(stream, lines: queue.Queue[str]) -> None:  # type: ignore[no-untyped-def]
        for line in stream:
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
        for stream in (self.process.stdout, self.process.stderr):
            if stream is not None:
                stream.close()
        return self.process.returncode
