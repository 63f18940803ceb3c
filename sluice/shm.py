"""POSIX shared memory on this host: client objects and Sluice's own segments.

Two kinds of objects live under ``/dev/shm``:

- *client objects*, created by a client (``tritonclient.utils.shared_memory``) and
  registered with a gateway as regions; Sluice maps them, never creates or removes them;
- *segments*, created by Sluice to move one request's large tensors between a gateway
  and a worker without copying them through Redis. A segment is named
  ``sluice-<namespace>-<creator pid>-<in|out>-<pid namespace>-<random>``: ``in``
  segments hold a request's inputs (the gateway creates them and unlinks them when the
  request ends), ``out`` segments hold a reply's outputs (a worker creates them, the
  gateway unlinks them once read). :func:`sweep_orphans` removes what a killed process
  left behind.

Objects are opened through their ``/dev/shm`` path, not ``multiprocessing.shared_memory``,
whose resource tracker would unlink objects it merely attached to.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import mmap
import os
import re
import secrets
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
SEGMENT_GRACE_S = 2.0
"""A segment of a dead creator is left alone this long: its reader may still be at it."""

_RESERVED = "sluice-"
_MAX_KEY = 255
_SEGMENT_TAIL = re.compile(r"^(\d+)-(in|out)-([0-9a-f]+)-[0-9a-f]{16}$")
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")
_PREFIX = re.compile(r"^sluice-[A-Za-z0-9_.-]{1,128}-$")

SegmentKind = Literal["in", "out"]


class ShmKeyError(ValueError):
    """A shared memory key that cannot name an object under /dev/shm."""


def object_name(key: str) -> str:
    """The file name under /dev/shm of a POSIX shm key (leading slashes dropped, as glibc)."""
    name = key.lstrip("/")
    if not name or name in (".", "..") or "/" in name or "\0" in name or len(name) > _MAX_KEY:
        raise ShmKeyError(f"'{key}' is not a valid POSIX shared memory key")
    return name


def object_path(key: str, directory: Path = SHM_DIR) -> Path:
    return directory / object_name(key)


def is_reserved(key: str) -> bool:
    """Keys Sluice uses for its own segments; clients may not register them."""
    return key.lstrip("/").startswith(_RESERVED)


def segment_prefix(namespace: str) -> str:
    """``sluice-<namespace>-``, the start of every segment name of one deployment."""
    return f"{_RESERVED}{_UNSAFE.sub('_', namespace)}-"


@functools.lru_cache(maxsize=64)
def is_segment_prefix(prefix: str) -> bool:
    return _PREFIX.match(prefix) is not None


@functools.cache
def pid_namespace() -> str:
    """This process's PID namespace (inode, hex): a pid means something only within it."""
    try:
        return format(os.stat("/proc/self/ns/pid").st_ino, "x")
    except OSError:
        return "0"


def new_segment_name(prefix: str, kind: SegmentKind) -> str:
    """``<prefix><pid>-<kind>-<pid namespace>-<random>``."""
    return f"{prefix}{os.getpid()}-{kind}-{pid_namespace()}-{secrets.token_hex(8)}"


def write_segment(
    name: str, buffers: Sequence[bytes | memoryview], directory: Path = SHM_DIR
) -> int:
    """Create segment ``name`` holding ``buffers`` back to back; returns its size.

    One kernel copy per buffer (``pwrite``); the segment is removed again if writing fails.
    """
    path = directory / object_name(name)
    size = sum(memoryview(b).nbytes for b in buffers)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, size)
        offset = 0
        for buffer in buffers:
            view = memoryview(buffer).cast("B")
            while view:
                written = os.pwrite(fd, view, offset)
                offset += written
                view = view[written:]
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        raise
    finally:
        os.close(fd)
    return size


def map_object(
    key: str, *, writable: bool = False, directory: Path = SHM_DIR
) -> tuple[mmap.mmap, tuple[int, int]]:
    """The whole object mapped shared, with its (device, inode) identity.

    Raises ``OSError`` (e.g. FileNotFoundError) or ``ValueError`` for an empty object.
    """
    path = object_path(key, directory)
    fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
    try:
        status = os.fstat(fd)
        access = mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ
        return mmap.mmap(fd, status.st_size, access=access), (status.st_dev, status.st_ino)
    finally:
        os.close(fd)


def object_size(key: str, directory: Path = SHM_DIR) -> int:
    """Size in bytes of the object; raises ``OSError`` when it does not exist."""
    return os.stat(object_path(key, directory)).st_size


def unlink(key: str, directory: Path = SHM_DIR) -> None:
    with contextlib.suppress(FileNotFoundError):
        object_path(key, directory).unlink()


def close_quietly(mapping: mmap.mmap) -> None:
    """Close a mapping now, or leave it to the garbage collector while views still use it."""
    with contextlib.suppress(BufferError):
        mapping.close()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_orphans(
    namespace: str,
    max_age_s: float,
    *,
    grace_s: float = SEGMENT_GRACE_S,
    directory: Path = SHM_DIR,
) -> list[str]:
    """Remove the namespace's segments that nobody will unlink; returns their names.

    A segment is an orphan when its creator process is gone (and it is older than
    ``grace_s``), or when it is an ``out`` segment older than ``max_age_s`` (its reader
    gave up: the request timed out or the gateway died). Safe to run from any process on
    the host, any number of times.
    """
    prefix = segment_prefix(namespace)
    now = time.time()
    removed: list[str] = []
    try:
        entries = list(os.scandir(directory))
    except OSError as exc:
        log.warning("cannot list %s: %s", directory, exc)
        return removed
    for entry in entries:
        if not entry.name.startswith(prefix):
            continue
        match = _SEGMENT_TAIL.match(entry.name[len(prefix) :])
        if match is None:
            continue
        try:
            age = now - entry.stat(follow_symlinks=False).st_mtime
        except FileNotFoundError:
            continue
        # A creator in another PID namespace (another container) is not ours to judge.
        local = match.group(3) == pid_namespace()
        dead = local and age >= grace_s and not _pid_alive(int(match.group(1)))
        stale = match.group(2) == "out" and age >= max_age_s
        if dead or stale:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)
                removed.append(entry.name)
    if removed:
        log.info("removed %d orphaned shared memory segments", len(removed))
    return removed
