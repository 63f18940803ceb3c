"""Which processes share a host: the ones that can hand each other shared memory.

A process's host id names its kernel boot and the /dev/shm it sees: processes of one
machine and one mount of /dev/shm (one container, or containers sharing it) get the same
id, processes on other machines or in containers with their own /dev/shm get others.
``SLUICE_HOST_ID`` overrides it (several test hosts on one machine, or an operator who
knows better).

Workers advertise theirs with their heartbeat (``Keys.worker_hosts``); a gateway uses
shared memory with a model version only while every live worker of it is on its own host.
"""

from __future__ import annotations

import hashlib
import os
import socket
from pathlib import Path

_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
_SHM = Path("/dev/shm")


def host_id(configured: str = "") -> str:
    """``configured`` if given, else this process's derived host id."""
    if configured:
        return configured
    try:
        boot = _BOOT_ID.read_text().strip()
    except OSError:
        boot = socket.gethostname()
    try:
        shm = os.stat(_SHM)
        mount = f"{shm.st_dev}:{shm.st_ino}"
    except OSError:
        mount = "no-shm"
    return hashlib.sha256(f"{boot}:{mount}".encode()).hexdigest()[:16]
