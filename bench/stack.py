"""Start and stop a Sluice stack (``sluice up``) as a subprocess of the bench."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from bench import cpu

READY_MARKER = "Sluice ready at http://"
_READY_URL = re.compile(r"Sluice ready at (http://\S+)")
START_TIMEOUT = 60.0
STOP_GRACE = 10.0


@dataclass
class Stack:
    """A running ``sluice up`` process; its output is drained by a thread into ``log``."""

    process: subprocess.Popen[str]
    port: int
    url: str | None = None
    log: deque[str] = field(default_factory=lambda: deque(maxlen=200))
    ready: threading.Event = field(default_factory=threading.Event)
    descendants: set[tuple[int, int]] = field(default_factory=set)  # (pid, start ticks)

    @property
    def pid(self) -> int:
        return self.process.pid


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _pump_output(stack: Stack, log_file: TextIO | None) -> None:
    """Read the stack's output until it exits; note the URL of the ready line."""
    assert stack.process.stdout is not None
    for line in stack.process.stdout:
        stack.log.append(line.rstrip("\n"))
        if log_file is not None:
            log_file.write(line)
            log_file.flush()
        if not stack.ready.is_set() and READY_MARKER in line:
            match = _READY_URL.search(line)
            stack.url = match.group(1).rstrip("/.,") if match else None
            stack.ready.set()
    if log_file is not None:
        log_file.close()


def start_stack(
    repository: Path,
    port: int | None = None,
    log_path: Path | None = None,
    extra_args: list[str] | None = None,
    env: dict[str, str] | None = None,
    timeout: float = START_TIMEOUT,
) -> Stack:
    """Run ``sluice up`` and wait for its ready line; raise (after stopping it) if none comes.

    ``env`` is added to the bench's environment (e.g. ``SLUICE_THREADS``).
    """
    port = port or free_port()
    command = [
        sys.executable,
        "-m",
        "sluice.cli",
        "up",
        "--model-repository",
        str(repository),
        "--http-port",
        str(port),
        "--metrics-port",
        "0",
        # No fixed gRPC port either (8001 may be taken); grpc_bench passes its own after.
        "--grpc-port",
        "0",
        *(extra_args or []),
    ]
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        errors="replace",
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        start_new_session=True,  # a Ctrl-C at the terminal reaches the bench, not the stack
    )
    stack = Stack(process=process, port=port)
    log_file = log_path.open("w") if log_path is not None else None
    threading.Thread(target=_pump_output, args=(stack, log_file), daemon=True).start()
    deadline = time.monotonic() + timeout
    while not stack.ready.wait(0.2):
        if process.poll() is not None or time.monotonic() > deadline:
            why = f"exited with {process.returncode}" if process.poll() is not None else "timeout"
            stop_stack(stack)
            tail = "\n".join(stack.log)
            raise RuntimeError(f"sluice up did not become ready ({why}); output:\n{tail}")
    if stack.url is None:
        stack.url = f"http://127.0.0.1:{port}"
    remember_descendants(stack)
    return stack


def remember_descendants(stack: Stack) -> None:
    """Note the stack's processes so that stray ones can be killed after it exits."""
    stack.descendants |= {(stat.pid, stat.start_ticks) for stat in cpu.tree(stack.pid)}


def stop_stack(stack: Stack, grace: float = STOP_GRACE) -> int | None:
    """SIGINT, then SIGKILL to the whole process group after ``grace`` seconds."""
    process = stack.process
    if process.poll() is None:
        remember_descendants(stack)
        process.send_signal(signal.SIGINT)
        try:
            process.wait(grace)
        except subprocess.TimeoutExpired:
            print(f"sluice up ignored SIGINT for {grace:g}s; killing it", file=sys.stderr)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    _kill_strays(stack)
    return process.returncode


def _kill_strays(stack: Stack) -> None:
    """SIGKILL processes of the stack that outlived it (same pid and start time only)."""
    for pid, start_ticks in stack.descendants:
        if pid == stack.pid:
            continue
        stat = cpu.read_stat(pid)
        if stat is not None and stat.start_ticks == start_ticks:
            print(f"killing stray stack process {pid}: {cpu.command_line(pid)}", file=sys.stderr)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def cnn_repository(source: Path, root: Path, instances: int = 1, extra: str = "") -> Path:
    """A repository at ``root`` holding only ``source``'s ``cnn`` model, on ``instances``
    CPU instances, its config followed by ``extra``."""
    model = root / "cnn"
    shutil.copytree(source / "cnn", model)
    config = model / "config.pbtxt"
    text = re.sub(r"instance_group \[.*?\]", "", config.read_text(), flags=re.DOTALL)
    group = f"instance_group [ {{ count: {instances} kind: KIND_CPU }} ]"
    config.write_text(f"{text}\n{group}\n{extra}")
    return root
