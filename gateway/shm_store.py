"""Where a host's client shared memory regions are recorded, so that every gateway process of
the host serves them (Triton's system and CUDA shared memory extensions across processes).

A region belongs to a host: a system region is a POSIX shm object of the host's /dev/shm, a
CUDA region an IPC handle of its GPUs. Its record (JSON: key, offset and size, or the
handle, device and size) lives in Redis, in a hash per host and kind
(:meth:`sluice.core.keys.Keys.client_regions`), with a revision counter that every change
moves. The records expire unless a live gateway of the host renews them at its catalog
refresh, so a host whose gateways are all gone leaves nothing behind for long.

Each gateway process keeps a copy (:class:`sluice.gateway.shm_registry.RegionRegistry`) and
must notice changes without a Redis round trip per request: the processes of one host share
a change counter in a small file of its /dev/shm (:class:`HostCounter`), which the process
that changed the records moves before it answers. A request compares it with the value its
process last loaded at (a read of mapped memory); when it moved, the process loads the
records again before it parses the request. The catalog refresh compares Redis's revision
as well, so a change the counter cannot show (Redis restarted, no /dev/shm) is seen within
``SLUICE_CATALOG_REFRESH_S``.

:class:`MemoryRegionStore` keeps the records in the process instead: a gateway without
Redis (in-process tests), where one process is all there is.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal, Protocol

from redis.asyncio import Redis

from sluice.core.errors import InvalidInput, QuotaExceeded
from sluice.core.keys import Keys
from sluice.core.shm import SHM_DIR

log = logging.getLogger(__name__)

Kind = Literal["system", "cuda"]
KINDS: tuple[Kind, Kind] = ("system", "cuda")

REGIONS_TTL_S = 60.0
"""The least time a host's records outlive the last renewal by one of its gateways."""


@dataclass(frozen=True, slots=True)
class Records:
    """Every record of the host at one revision: kind -> name -> record (JSON bytes)."""

    revision: int
    system: dict[str, bytes] = field(default_factory=dict)
    cuda: dict[str, bytes] = field(default_factory=dict)


class RegionStore(Protocol):
    """The records of one host's regions, shared by its gateway processes."""

    async def add(self, kind: Kind, name: str, record: bytes, limit: int) -> None:
        """Record a region; the name must be free in both kinds, and fewer than ``limit``
        regions recorded (InvalidInput, QuotaExceeded)."""

    async def remove(self, kind: Kind, name: str | None) -> None:
        """Forget one region of ``kind`` (an unknown name is no error), or all (None)."""

    async def load(self, known: int | None) -> Records | None:
        """The records, or None when their revision is still ``known``; renews them."""


def already_registered(name: str) -> InvalidInput:
    return InvalidInput(f"shared memory region '{name}' already in manager")


def too_many(name: str, limit: int) -> QuotaExceeded:
    return QuotaExceeded(
        f"failed to register shared memory region '{name}': {limit} regions are registered "
        f"on this host already, the most SLUICE_MAX_SHM_REGIONS allows; unregister one first"
    )


@dataclass
class MemoryRegionStore:
    """The records in this process (one gateway process, no Redis)."""

    records: Records = field(default_factory=lambda: Records(0))

    async def add(self, kind: Kind, name: str, record: bytes, limit: int) -> None:
        now = self.records
        if name in now.system or name in now.cuda:
            raise already_registered(name)
        if len(now.system) + len(now.cuda) >= limit:
            raise too_many(name, limit)
        self._set(kind, {**_of(now, kind), name: record})

    async def remove(self, kind: Kind, name: str | None) -> None:
        regions = _of(self.records, kind)
        if name is None and regions:
            self._set(kind, {})
        elif name is not None and name in regions:
            self._set(kind, {n: r for n, r in regions.items() if n != name})

    async def load(self, known: int | None) -> Records | None:
        return None if known == self.records.revision else self.records

    def _set(self, kind: Kind, regions: dict[str, bytes]) -> None:
        now = self.records
        system, cuda = (regions, now.cuda) if kind == "system" else (now.system, regions)
        self.records = Records(now.revision + 1, system, cuda)


def _of(records: Records, kind: Kind) -> dict[str, bytes]:
    return records.system if kind == "system" else records.cuda


# KEYS: this kind's hash, the other kind's hash, the revision. ARGV: name, record, limit, ttl ms.
_ADD = """
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1 or redis.call('HEXISTS', KEYS[2], ARGV[1]) == 1 then
  return 'exists'
end
if redis.call('HLEN', KEYS[1]) + redis.call('HLEN', KEYS[2]) >= tonumber(ARGV[3]) then
  return 'full'
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('INCR', KEYS[3])
for i = 1, 3 do redis.call('PEXPIRE', KEYS[i], ARGV[4]) end
return 'ok'
"""

# KEYS: the kind's hash, the revision. ARGV: 'one' or 'all', name, ttl ms.
_REMOVE = """
local removed
if ARGV[1] == 'all' then
  removed = redis.call('DEL', KEYS[1])
else
  removed = redis.call('HDEL', KEYS[1], ARGV[2])
end
if removed > 0 then
  redis.call('INCR', KEYS[2])
  redis.call('PEXPIRE', KEYS[2], ARGV[3])
end
return removed
"""

# KEYS: system hash, cuda hash, revision. ARGV: the revision known ('' for none), ttl ms.
_LOAD = """
local revision = redis.call('GET', KEYS[3]) or '0'
for i = 1, 3 do redis.call('PEXPIRE', KEYS[i], ARGV[2]) end
if revision == ARGV[1] then
  return {revision}
end
return {revision, redis.call('HGETALL', KEYS[1]), redis.call('HGETALL', KEYS[2])}
"""


def _pairs(flat: list[bytes]) -> dict[str, bytes]:
    return {flat[i].decode(): flat[i + 1] for i in range(0, len(flat), 2)}


class RedisRegionStore:
    """The records of one host in Redis, for every gateway process of that host."""

    def __init__(self, redis: Redis, keys: Keys, host: str, ttl_s: float = REGIONS_TTL_S) -> None:
        self.keys = {kind: keys.client_regions(host, kind) for kind in KINDS}
        self.revision_key = keys.client_regions_revision(host)
        self.ttl_ms = int(ttl_s * 1000)
        self._add = redis.register_script(_ADD)
        self._remove = redis.register_script(_REMOVE)
        self._load = redis.register_script(_LOAD)

    async def add(self, kind: Kind, name: str, record: bytes, limit: int) -> None:
        other: Kind = "cuda" if kind == "system" else "system"
        outcome = await self._add(
            keys=[self.keys[kind], self.keys[other], self.revision_key],
            args=[name, record, limit, self.ttl_ms],
        )
        if outcome == b"exists":
            raise already_registered(name)
        if outcome == b"full":
            raise too_many(name, limit)

    async def remove(self, kind: Kind, name: str | None) -> None:
        which = ["all", ""] if name is None else ["one", name]
        await self._remove(keys=[self.keys[kind], self.revision_key], args=[*which, self.ttl_ms])

    async def load(self, known: int | None) -> Records | None:
        answer = await self._load(
            keys=[self.keys["system"], self.keys["cuda"], self.revision_key],
            args=["" if known is None else str(known), self.ttl_ms],
        )
        revision = int(answer[0])
        if len(answer) == 1:
            return None
        return Records(revision, _pairs(answer[1]), _pairs(answer[2]))


class ChangeCounter(Protocol):
    """Moves whenever a process changed the records; read on every use of a region."""

    def value(self) -> int: ...

    def bump(self) -> None: ...

    def close(self) -> None: ...


class LocalCounter:
    """No other process to tell (:class:`MemoryRegionStore`): never moves."""

    def value(self) -> int:
        return 0

    def bump(self) -> None:
        pass

    def close(self) -> None:
        pass


_COUNTER = struct.Struct("<Q")


class HostCounter:
    """A counter in a small file of this host's /dev/shm, shared by the gateway processes of
    one deployment (namespace) and host id. Reading it is a read of mapped memory; moving it
    takes the file's lock. Where it cannot be made (no /dev/shm, the name held by another
    user), it never moves and changes are seen at the catalog refresh."""

    def __init__(
        self,
        namespace: str,
        host: str,
        directory: os.PathLike[str] | None = None,
        *,
        topic: str = "regions",
    ):
        """``topic``: what the counter tells of (``regions``: client shared-memory regions;
        ``changes``: model-control and log-settings changes)."""
        # '~' is in no namespace, so the name is no segment of any deployment's
        # (sluice.core.shm) and the sweeper leaves it; the prefix is reserved to Sluice.
        self.topic = topic
        self.path = os.path.join(directory or SHM_DIR, f"sluice-{topic}~{namespace}~{host}")
        self._fd = -1
        self._map: mmap.mmap | None = None
        try:
            self._open()
        except OSError as exc:
            self.close()
            log.warning(
                "no shared change counter for %s (%s): other gateway processes see changes "
                "at their next catalog refresh",
                topic,
                exc,
            )

    def _open(self) -> None:
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        self._fd = os.open(self.path, flags, 0o600)
        status = os.fstat(self._fd)
        if status.st_uid != os.geteuid():
            raise PermissionError(f"{self.path} belongs to another user")
        if status.st_size < _COUNTER.size:
            with _locked(self._fd):
                if os.fstat(self._fd).st_size < _COUNTER.size:
                    os.ftruncate(self._fd, _COUNTER.size)
        self._map = mmap.mmap(self._fd, _COUNTER.size)

    def value(self) -> int:
        mapped = self._map
        return 0 if mapped is None else int(_COUNTER.unpack_from(mapped, 0)[0])

    def bump(self) -> None:
        mapped = self._map
        if mapped is None:
            return
        with _locked(self._fd):
            now = _COUNTER.unpack_from(mapped, 0)[0]
            _COUNTER.pack_into(mapped, 0, (now + 1) & 0xFFFFFFFFFFFFFFFF)

    def close(self) -> None:
        mapped, self._map = self._map, None
        if mapped is not None:
            mapped.close()
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)


@contextlib.contextmanager
def _locked(fd: int) -> Iterator[None]:
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
