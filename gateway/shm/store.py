"""Where a host's client shared memory regions are recorded, so that every gateway process of
the host serves them (Triton's system and CUDA shared memory extensions across processes).

A region belongs to a host: a system region is a POSIX shm object of the host's /dev/shm, a
CUDA region an IPC handle of its GPUs. Its record (JSON: key, offset and size, or the
handle, device and size) lives in Redis, in a hash per host and kind
(:meth:`sluice.core.keys.Keys.client_regions`), with a revision counter that every change
moves. The records expire unless a live gateway of the host renews them at its catalog
refresh, so a host whose gateways are all gone leaves nothing behind for long.

A record's name is ``<tenant>/<name>`` (:func:`sluice.gateway.shm.registry.scoped`). The
host holds at most ``SLUICE_MAX_SHM_REGIONS`` records, and each tenant at most
``SLUICE_TENANT_MAX_SHM_REGIONS`` of them, both checked by the script that adds one (so two
gateway processes cannot both take the last place); a tenant's are counted by a pass over
the host's names, no more than the host's bound. Records written before regions belonged
to tenants (a name without ``/``) are nobody's: no tenant can see, use or unregister them,
so every load that reads the records removes them (a gateway's first load, as it starts,
among them), and they no longer count against the host's bound.

The requests in flight that use a region hold a lease on it, next to the records
(:meth:`sluice.core.keys.Keys.client_region_users`), whatever gateway process of the host runs
them: unregistering a region that has live leases only marks it *draining* (as Triton, it
stays listed and usable, and its name stays taken) and the release of its last lease removes
it. A lease expires at its request's deadline, so a request that never ends, or a gateway
process that died with requests in flight, holds a region no longer than that: the next
load of the records (every catalog refresh) removes a draining region whose leases all
expired. The leases live with the records rather than in each process because a region
unregistered through one process must wait for the requests of all of them, and only a
shared record outlives a process that died.

Each gateway process keeps a copy (:class:`sluice.gateway.shm.registry.RegionRegistry`) and
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
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Literal, Protocol

from redis.asyncio import Redis

from sluice.core.clock import CLOCK
from sluice.core.errors import InvalidInput, QuotaExceeded
from sluice.core.keys import Keys
from sluice.core.shm import SHM_DIR

log = logging.getLogger(__name__)

Kind = Literal["system", "cuda"]
KINDS: tuple[Kind, Kind] = ("system", "cuda")

REGIONS_TTL_S = 60.0
"""The least time a host's records outlive the last renewal by one of its gateways."""

Clock = Callable[[], int]
"""The deployment's time in ms (leases expire by it)."""


def deployment_ms() -> int:
    return CLOCK.now_ns() // 1_000_000


@dataclass(frozen=True, slots=True)
class Records:
    """Every record of the host at one revision: kind -> name -> record (JSON bytes)."""

    revision: int
    system: dict[str, bytes] = field(default_factory=dict)
    cuda: dict[str, bytes] = field(default_factory=dict)
    draining: frozenset[str] = frozenset()
    """Regions unregistered while requests used them: listed until those requests end."""


class RegionStore(Protocol):
    """The records of one host's regions, shared by its gateway processes, and the leases
    of the requests in flight that use them."""

    async def add(self, kind: Kind, name: str, record: bytes, limits: RegionLimits) -> None:
        """Record a region; the name must be free in both kinds (a draining region still
        holds it), and fewer regions than ``limits`` allow recorded, the host's and the
        tenant's (``name``'s, :func:`tenant_of`) (InvalidInput, QuotaExceeded)."""

    async def remove(self, kind: Kind, name: str | None, within: str = "") -> None:
        """Forget one region of ``kind`` (an unknown name is no error), or (None) all those
        whose names start with ``within`` (one tenant's); one with live leases is marked
        draining instead, and goes with its last lease."""

    async def load(self, known: int | None) -> Records | None:
        """The records, or None when their revision is still ``known``; renews them, and
        first removes the draining regions whose leases all ended or expired (and, when it
        answers the records, those of no tenant, see above)."""

    async def hold(self, records: dict[str, bytes], lease: str, ttl_ms: int) -> str | None:
        """Lease each region named in ``records`` for ``ttl_ms`` (a request's time left),
        provided each is still recorded as given (registered or draining); else lease none
        and answer the name of one that is not."""

    async def release(self, names: list[str], lease: str) -> bool:
        """End the lease on these regions; whether a draining one went with it."""


@dataclass(frozen=True, slots=True)
class RegionLimits:
    """The most regions recorded at once: on the host, and of one tenant on it."""

    host: int
    tenant: int


def tenant_of(name: str) -> str:
    """The tenant a record's name (``<tenant>/<name>``) belongs to."""
    return name.partition("/")[0]


def _shown(name: str) -> str:
    """A region's name as its tenant knows it (records name it ``<tenant>/<name>``)."""
    return name.partition("/")[2] or name


def already_registered(name: str, *, draining: bool = False) -> InvalidInput:
    detail = (
        "; it was unregistered while requests in flight used it, and goes once they end"
        if draining
        else ""
    )
    return InvalidInput(f"shared memory region '{_shown(name)}' already in manager{detail}")


def too_many(name: str, limit: int) -> QuotaExceeded:
    return QuotaExceeded(
        f"failed to register shared memory region '{_shown(name)}': {limit} regions are registered "
        f"on this host already, the most SLUICE_MAX_SHM_REGIONS allows; unregister one first"
    )


def too_many_of_tenant(name: str, limit: int) -> QuotaExceeded:
    return QuotaExceeded(
        f"failed to register shared memory region '{_shown(name)}': tenant '{tenant_of(name)}' "
        f"has {limit} regions registered on this host already, the most "
        "SLUICE_TENANT_MAX_SHM_REGIONS allows; unregister one first"
    )


@dataclass
class MemoryRegionStore:
    """The records in this process (one gateway process, no Redis)."""

    records: Records = field(default_factory=lambda: Records(0))
    users: dict[str, dict[str, int]] = field(default_factory=dict)
    """Region name -> lease -> when it expires (ms)."""
    clock: Clock = deployment_ms

    async def add(self, kind: Kind, name: str, record: bytes, limits: RegionLimits) -> None:
        if name in self.records.draining and not self._live(name):
            self._drop([name])
        now = self.records
        if name in now.system or name in now.cuda:
            raise already_registered(name, draining=name in now.draining)
        prefix = tenant_of(name) + "/"
        owned = sum(1 for n in (*now.system, *now.cuda) if n.startswith(prefix))
        if owned >= limits.tenant:
            raise too_many_of_tenant(name, limits.tenant)
        if len(now.system) + len(now.cuda) >= limits.host:
            raise too_many(name, limits.host)
        self._set(kind, {**_of(now, kind), name: record})

    async def remove(self, kind: Kind, name: str | None, within: str = "") -> None:
        regions = _of(self.records, kind)
        if name is None:
            names = [n for n in regions if n.startswith(within)]
        else:
            names = [name] if name in regions else []
        held = {n for n in names if self._live(n)}
        if held - self.records.draining:
            now = self.records
            self.records = Records(
                now.revision + 1, now.system, now.cuda, now.draining | frozenset(held)
            )
        self._drop([n for n in names if n not in held])

    async def load(self, known: int | None) -> Records | None:
        self._drop([n for n in self.records.draining if not self._live(n)])
        return None if known == self.records.revision else self.records

    async def hold(self, records: dict[str, bytes], lease: str, ttl_ms: int) -> str | None:
        now = self.records
        for name, record in records.items():
            if record not in (now.system.get(name), now.cuda.get(name)):
                return name
        expires = self.clock() + ttl_ms
        for name in records:
            self._live(name)
            self.users.setdefault(name, {})[lease] = expires
        return None

    async def release(self, names: list[str], lease: str) -> bool:
        for name in names:
            leases = self.users.get(name, {})
            leases.pop(lease, None)
            if not leases:
                self.users.pop(name, None)
        return self._drop([n for n in names if n in self.records.draining and not self._live(n)])

    def _live(self, name: str) -> int:
        """Leases on ``name`` that have not expired (forgetting those that have)."""
        now = self.clock()
        leases = {lease: at for lease, at in self.users.pop(name, {}).items() if at > now}
        if leases:
            self.users[name] = leases
        return len(leases)

    def _drop(self, names: list[str]) -> bool:
        """Forget these regions, whatever their kind; whether there were any."""
        if not names:
            return False
        now = self.records
        self.records = Records(
            now.revision + 1,
            {n: r for n, r in now.system.items() if n not in names},
            {n: r for n, r in now.cuda.items() if n not in names},
            now.draining - frozenset(names),
        )
        for name in names:
            self.users.pop(name, None)
        return True

    def _set(self, kind: Kind, regions: dict[str, bytes]) -> None:
        now = self.records
        system, cuda = (regions, now.cuda) if kind == "system" else (now.system, regions)
        self.records = Records(now.revision + 1, system, cuda, now.draining)


def _of(records: Records, kind: Kind) -> dict[str, bytes]:
    return records.system if kind == "system" else records.cuda


# Every script: KEYS: the system hash, the cuda hash, the revision, the draining hash;
# ARGV[1]: the prefix of the regions' lease sets, ARGV[2]: the time now (ms).
_COMMON = """
local users, now = ARGV[1], ARGV[2]
local function live(name)
  local key = users .. name
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
  return redis.call('ZCARD', key)
end
local function drop(name)
  redis.call('HDEL', KEYS[1], name)
  redis.call('HDEL', KEYS[2], name)
  redis.call('HDEL', KEYS[4], name)
  redis.call('DEL', users .. name)
end
"""

# ARGV[3..]: the kind's index in KEYS (1 or 2), name, record, the host's limit, ttl ms, the
# tenant's limit, the start of the tenant's names ('<tenant>/').
_ADD = (
    _COMMON
    + """
local kind, name = tonumber(ARGV[3]), ARGV[4]
local function owned(prefix)
  local count = 0
  for i = 1, 2 do
    for _, field in ipairs(redis.call('HKEYS', KEYS[i])) do
      if string.sub(field, 1, #prefix) == prefix then count = count + 1 end
    end
  end
  return count
end
if redis.call('HEXISTS', KEYS[4], name) == 1 and live(name) == 0 then
  drop(name)
  redis.call('INCR', KEYS[3])
end
if redis.call('HEXISTS', KEYS[1], name) == 1 or redis.call('HEXISTS', KEYS[2], name) == 1 then
  if redis.call('HEXISTS', KEYS[4], name) == 1 then return 'draining' end
  return 'exists'
end
if owned(ARGV[9]) >= tonumber(ARGV[8]) then
  return 'tenant-full'
end
if redis.call('HLEN', KEYS[1]) + redis.call('HLEN', KEYS[2]) >= tonumber(ARGV[6]) then
  return 'full'
end
redis.call('HSET', KEYS[kind], name, ARGV[5])
redis.call('INCR', KEYS[3])
for i = 1, 4 do redis.call('PEXPIRE', KEYS[i], ARGV[7]) end
return 'ok'
"""
)

# ARGV[3..]: the kind's index in KEYS (1 or 2), 'one' and a name or 'all' and the start of
# the names, ttl ms.
_REMOVE = (
    _COMMON
    + """
local kind = tonumber(ARGV[3])
local names = {}
if ARGV[4] == 'all' then
  local within = ARGV[5]
  for _, name in ipairs(redis.call('HKEYS', KEYS[kind])) do
    if string.sub(name, 1, #within) == within then table.insert(names, name) end
  end
elseif redis.call('HEXISTS', KEYS[kind], ARGV[5]) == 1 then
  names = {ARGV[5]}
end
local changed = 0
for _, name in ipairs(names) do
  if live(name) > 0 then
    changed = changed + redis.call('HSET', KEYS[4], name, kind)
  else
    drop(name)
    changed = changed + 1
  end
end
if changed > 0 then
  redis.call('INCR', KEYS[3])
  for i = 1, 4 do redis.call('PEXPIRE', KEYS[i], ARGV[6]) end
end
return changed
"""
)

# ARGV[3..]: the revision known ('' for none), ttl ms. Answers the revision alone, or the
# revision, both kinds' records, the draining names, and how many records of no tenant
# (written before records were named '<tenant>/<name>') it removed.
_LOAD = (
    _COMMON
    + """
local gone = 0
for _, name in ipairs(redis.call('HKEYS', KEYS[4])) do
  if live(name) == 0 then
    drop(name)
    gone = gone + 1
  end
end
if gone > 0 then redis.call('INCR', KEYS[3]) end
local revision = redis.call('GET', KEYS[3]) or '0'
for i = 1, 4 do redis.call('PEXPIRE', KEYS[i], ARGV[4]) end
if revision == ARGV[3] then
  return {revision}
end
local legacy = 0
for _, index in ipairs({1, 2, 4}) do
  for _, name in ipairs(redis.call('HKEYS', KEYS[index])) do
    if not string.find(name, '/', 1, true) then
      drop(name)
      legacy = legacy + 1
    end
  end
end
if legacy > 0 then revision = tostring(redis.call('INCR', KEYS[3])) end
return {revision, redis.call('HGETALL', KEYS[1]), redis.call('HGETALL', KEYS[2]),
        redis.call('HKEYS', KEYS[4]), legacy}
"""
)

# ARGV[3..]: the lease, when it expires (ms), how long its sets must last (ms), then name
# and record of each region.
_HOLD = (
    _COMMON
    + """
for i = 6, #ARGV, 2 do
  local name, record = ARGV[i], ARGV[i + 1]
  local system, cuda = redis.call('HGET', KEYS[1], name), redis.call('HGET', KEYS[2], name)
  if system ~= record and cuda ~= record then return name end
end
for i = 6, #ARGV, 2 do
  local key = users .. ARGV[i]
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
  redis.call('ZADD', key, ARGV[4], ARGV[3])
  if redis.call('PTTL', key) < tonumber(ARGV[5]) then redis.call('PEXPIRE', key, ARGV[5]) end
end
return ''
"""
)

# ARGV[3..]: the lease, then the names of its regions.
_RELEASE = (
    _COMMON
    + """
local gone = 0
for i = 4, #ARGV do
  local name = ARGV[i]
  redis.call('ZREM', users .. name, ARGV[3])
  if redis.call('HEXISTS', KEYS[4], name) == 1 and live(name) == 0 then
    drop(name)
    gone = gone + 1
  end
end
if gone > 0 then redis.call('INCR', KEYS[3]) end
return gone
"""
)

_LEASE_MARGIN_MS = 1000
"""A region's lease set outlives its last lease by this much."""


def _pairs(flat: list[bytes]) -> dict[str, bytes]:
    return {flat[i].decode(): flat[i + 1] for i in range(0, len(flat), 2)}


class RedisRegionStore:
    """The records of one host in Redis, for every gateway process of that host."""

    def __init__(
        self,
        redis: Redis,
        keys: Keys,
        host: str,
        ttl_s: float = REGIONS_TTL_S,
        clock: Clock = deployment_ms,
    ) -> None:
        self.keys = [
            keys.client_regions(host, "system"),
            keys.client_regions(host, "cuda"),
            keys.client_regions_revision(host),
            keys.client_regions_draining(host),
        ]
        self.users = keys.client_region_users(host, "")
        self.ttl_ms = int(ttl_s * 1000)
        self.clock = clock
        self._add = redis.register_script(_ADD)
        self._remove = redis.register_script(_REMOVE)
        self._load = redis.register_script(_LOAD)
        self._hold = redis.register_script(_HOLD)
        self._release = redis.register_script(_RELEASE)

    def _args(self, *more: str | bytes | int) -> list[str | bytes | int]:
        return [self.users, self.clock(), *more]

    async def add(self, kind: Kind, name: str, record: bytes, limits: RegionLimits) -> None:
        host, tenant, prefix = limits.host, limits.tenant, tenant_of(name) + "/"
        args = self._args(_index(kind), name, record, host, self.ttl_ms, tenant, prefix)
        outcome = await self._add(keys=self.keys, args=args)
        if outcome in (b"exists", b"draining"):
            raise already_registered(name, draining=outcome == b"draining")
        if outcome == b"tenant-full":
            raise too_many_of_tenant(name, limits.tenant)
        if outcome == b"full":
            raise too_many(name, limits.host)

    async def remove(self, kind: Kind, name: str | None, within: str = "") -> None:
        which = ["all", within] if name is None else ["one", name]
        await self._remove(keys=self.keys, args=self._args(_index(kind), *which, self.ttl_ms))

    async def load(self, known: int | None) -> Records | None:
        answer = await self._load(
            keys=self.keys, args=self._args("" if known is None else str(known), self.ttl_ms)
        )
        revision = int(answer[0])
        if len(answer) == 1:
            return None
        if answer[4]:
            log.info(
                "removed %d shared memory region records of no tenant (written before regions "
                "belonged to tenants): no tenant could see, use or unregister them",
                answer[4],
            )
        draining = frozenset(name.decode() for name in answer[3])
        return Records(revision, _pairs(answer[1]), _pairs(answer[2]), draining)

    async def hold(self, records: dict[str, bytes], lease: str, ttl_ms: int) -> str | None:
        now = self.clock()
        pairs = [part for name, record in records.items() for part in (name, record)]
        args = [self.users, now, lease, now + ttl_ms, ttl_ms + _LEASE_MARGIN_MS, *pairs]
        missing = await self._hold(keys=self.keys, args=args)
        return missing.decode() if missing else None

    async def release(self, names: list[str], lease: str) -> bool:
        gone = await self._release(keys=self.keys, args=self._args(lease, *names))
        return bool(gone)


def _index(kind: Kind) -> int:
    """The kind's place in the scripts' KEYS."""
    return 1 if kind == "system" else 2


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
