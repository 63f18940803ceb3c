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
whose resource tracker would unlink objects it merely attached to, and always with
``O_NOFOLLOW``: a key must name a plain object (a regular file with one name), never a
link to a file the client could not open itself, nor to another request's segment.

A client object is never mapped. Its owner may shrink it at any moment, and touching a
mapping beyond the end of its object kills the process with SIGBUS; so its bytes are
copied with ``pread``/``pwrite`` (:func:`read_object`, :func:`write_object`), where a
shrunken object is merely a short read: an error for the one request that uses it.
Segments (Sluice's own, mode 0600, never registrable by clients) may be mapped.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import mmap
import os
import re
import secrets
import stat
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Literal

import numpy as np

from sluice.core.runtime import pid_alive

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
SEGMENT_GRACE_S = 2.0
"""A segment of a dead creator is left alone this long: its reader may still be at it."""

_RESERVED = "sluice-"
TRITON_RESERVED = "triton_python_backend_shm_region_"
"""Triton's Python backend names its own objects so; Triton refuses to register them."""
RESERVED_PREFIXES = (_RESERVED, TRITON_RESERVED)
_OPEN_FLAGS = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK  # NONBLOCK: a FIFO cannot hang us
_CHUNK = 1 << 30  # Linux moves at most ~2 GiB per read/write call
_MAX_KEY = 255
_SEGMENT_TAIL = re.compile(r"^(\d+)-(in|out)-([0-9a-f]+)-[0-9a-f]{16}$")
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")
_PREFIX = re.compile(r"^sluice-[A-Za-z0-9_.-]{1,128}-$")

SegmentKind = Literal["in", "out"]


class ShmKeyError(ValueError):
    """A shared memory key that cannot name an object under /dev/shm."""


class UnsafeObject(ValueError):
    """The key names something a region may not be: a link, or not a regular file."""


class ObjectTooSmall(ValueError):
    """The object does not hold the bytes asked for (it may have shrunk meanwhile)."""


def object_name(key: str) -> str:
    """The file name under /dev/shm of a POSIX shm key (leading slashes dropped, as glibc)."""
    name = key.lstrip("/")
    if not name or name in (".", "..") or "/" in name or "\0" in name or len(name) > _MAX_KEY:
        raise ShmKeyError(f"'{key}' is not a valid POSIX shared memory key")
    return name


def object_path(key: str, directory: Path = SHM_DIR) -> Path:
    return directory / object_name(key)


def reserved_prefix(key: str) -> str:
    """The reserved prefix ``key`` starts with (Sluice's segments, Triton's Python
    backend), with or without its leading slashes; "" when none."""
    name = key.lstrip("/")
    return next((prefix for prefix in RESERVED_PREFIXES if name.startswith(prefix)), "")


@contextlib.contextmanager
def opened(
    key: str, *, writable: bool = False, directory: Path = SHM_DIR
) -> Iterator[tuple[int, os.stat_result]]:
    """A descriptor on the object ``key`` names, with its status, closed afterwards.

    Refused with :class:`UnsafeObject`: a symbolic link (``O_NOFOLLOW``, as glibc's
    ``shm_open``), anything but a regular file (a FIFO, a directory), and an object with
    several names: a hard link to someone else's object reads it as well as a symbolic
    one, and an object made by ``shm_open`` has exactly one name. Other failures raise
    :class:`ShmKeyError` or ``OSError`` (``FileNotFoundError`` when nothing is there).
    """
    path = object_path(key, directory)
    try:
        fd = os.open(path, (os.O_RDWR if writable else os.O_RDONLY) | _OPEN_FLAGS)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafeObject("it is a symbolic link") from None
        raise
    try:
        status = os.fstat(fd)
        if not stat.S_ISREG(status.st_mode):
            raise UnsafeObject("it is not a regular file")
        if status.st_nlink > 1:
            raise UnsafeObject(f"it is a hard link ({status.st_nlink} names for one object)")
        yield fd, status
    finally:
        os.close(fd)


def _check_extent(size: int, offset: int, byte_size: int) -> None:
    if offset + byte_size > size:
        raise ObjectTooSmall(f"it holds {size} bytes, the tensor reaches byte {offset + byte_size}")


def check_object(key: str, offset: int, byte_size: int, *, directory: Path = SHM_DIR) -> None:
    """The object is safe to use and holds ``byte_size`` bytes at ``offset`` now."""
    with opened(key, directory=directory) as (_, status):
        _check_extent(status.st_size, offset, byte_size)


def read_object(key: str, offset: int, byte_size: int, *, directory: Path = SHM_DIR) -> memoryview:
    """A copy of ``byte_size`` bytes at ``offset`` of the object, read with ``preadv`` into
    a fresh buffer (never a mapping); writable.

    Blocking and stateless: safe from any thread. :class:`ObjectTooSmall` when the
    object does not hold them, or shrank while they were read."""
    with opened(key, directory=directory) as (fd, status):
        _check_extent(status.st_size, offset, byte_size)
        # numpy's uninitialised buffer: 3x faster than bytes/bytearray for 32 MiB here.
        buffer = memoryview(np.empty(byte_size, np.uint8))  # type: ignore[arg-type]
        got = 0
        while got < byte_size:
            count = os.preadv(fd, [buffer[got : got + _CHUNK]], offset + got)
            if count == 0:
                raise ObjectTooSmall(
                    f"it shrank to {offset + got} bytes while being read, "
                    f"the tensor reaches byte {offset + byte_size}"
                )
            got += count
    return buffer


def write_object(
    key: str, offset: int, data: bytes | memoryview, *, directory: Path = SHM_DIR
) -> None:
    """Copy ``data`` to ``offset`` of the object (``pwrite``, never a mapping).

    Should the object shrink meanwhile, the write grows it back up to where ``data``
    ends (within the region the client registered), and nothing worse happens."""
    view = memoryview(data).cast("B")
    with opened(key, writable=True, directory=directory) as (fd, status):
        _check_extent(status.st_size, offset, view.nbytes)
        _write_all(fd, view, offset)


def _write_all(fd: int, view: memoryview, offset: int) -> None:
    while view:
        written = os.pwrite(fd, view[:_CHUNK], offset)
        offset += written
        view = view[written:]


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
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | _OPEN_FLAGS, 0o600)
    try:
        os.ftruncate(fd, size)
        offset = 0
        for buffer in buffers:
            view = memoryview(buffer).cast("B")
            _write_all(fd, view, offset)
            offset += view.nbytes
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        raise
    finally:
        os.close(fd)
    return size


def map_segment(key: str, *, directory: Path = SHM_DIR) -> mmap.mmap:
    """A segment of Sluice's own, mapped read-only: never a client object (see above).

    Raises ``OSError`` (e.g. FileNotFoundError), :class:`UnsafeObject`, or ``ValueError``
    for an empty segment.
    """
    with opened(key, directory=directory) as (fd, status):
        return mmap.mmap(fd, status.st_size, access=mmap.ACCESS_READ)


def unlink(key: str, directory: Path = SHM_DIR) -> None:
    with contextlib.suppress(FileNotFoundError):
        object_path(key, directory).unlink()


def close_quietly(mapping: mmap.mmap) -> None:
    """Close a mapping now, or leave it to the garbage collector while views still use it."""
    with contextlib.suppress(BufferError):
        mapping.close()


def segment_bytes(namespace: str, directory: Path = SHM_DIR) -> int:
    """Bytes of the namespace's gateway-worker segments in ``directory`` (a directory walk:
    call it off the event loop)."""
    prefix = segment_prefix(namespace)
    total = 0
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return 0
    for entry in entries:
        if entry.name.startswith(prefix):
            with contextlib.suppress(OSError):
                total += entry.stat(follow_symlinks=False).st_size
    return total


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
        dead = local and age >= grace_s and not pid_alive(int(match.group(1)))
        stale = match.group(2) == "out" and age >= max_age_s
        if dead or stale:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)
                removed.append(entry.name)
    if removed:
        log.info("removed %d orphaned shared memory segments", len(removed))
    return removed
