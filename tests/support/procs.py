"""The processes of a running stack, read from /proc (Linux)."""

from __future__ import annotations

import itertools
import os
import time
from pathlib import Path


def children(pid: int) -> set[int]:
    """Live (non-zombie) direct children of ``pid``."""
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            if int(fields[1]) == pid and fields[0] != "Z":
                found.add(int(entry))
    return found


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def cmdline(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def environment(pid: int) -> dict[str, str]:
    """The environment ``pid`` was started with (empty when it cannot be read)."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    pairs = (part.decode(errors="replace").partition("=") for part in raw.split(b"\0") if part)
    return {name: value for name, _, value in pairs}


def _is_module(pid: int, module: str) -> bool:
    argv = cmdline(pid)
    names = (module, f"sluice.{module}")  # (services run as ``-m sluice.<service>``)
    return any(a == "-m" and b in names for a, b in itertools.pairwise(argv))


def gateway_pids(parent: int) -> list[int]:
    """The gateway processes under ``parent`` (``--gateway-processes``), in pid order."""
    return sorted(pid for pid in children(parent) if _is_module(pid, "gateway"))


def gateway_pid(parent: int) -> int:
    """The one gateway under ``parent`` (a stack started with ``--gateway-processes 1``)."""
    found = gateway_pids(parent)
    assert len(found) == 1, f"expected one gateway under {parent}, found {found}"
    return found[0]


def worker_pids(parent: int, model: str | None = None) -> set[int]:
    """The worker children of ``parent`` (``sluice up``), optionally of one model."""
    pids = set()
    for pid in children(parent):
        if not _is_module(pid, "workers"):
            continue
        argv = cmdline(pid)
        if model is None or ("--model" in argv and argv[argv.index("--model") + 1] == model):
            pids.add(pid)
    return pids


def redis_server_pid(parent: int) -> int:
    """The private redis-server that ``sluice up`` (``parent``) started."""
    found = [pid for pid in children(parent) if _is_redis(pid)]
    assert len(found) == 1, f"expected one redis-server under {parent}, found {found}"
    return found[0]


def _is_redis(pid: int) -> bool:
    # redis-server rewrites its title: argv[0] becomes "/path/redis-server 127.0.0.1:PORT".
    argv = cmdline(pid)
    return bool(argv) and Path(argv[0].split()[0]).name == "redis-server"


def rss_mb(pid: int) -> float:
    """Resident set size (VmRSS) in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def wait_until(predicate, timeout_s: float, interval_s: float = 0.05) -> bool:  # type: ignore[no-untyped-def]
    """Poll ``predicate`` until it is true (returns True) or the time is up (False)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if predicate():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(interval_s)
