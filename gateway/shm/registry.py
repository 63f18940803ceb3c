"""Shared memory regions clients registered (Triton's system and CUDA extensions).

A region belongs to its host, not to the gateway process that registered it: the records
live in Redis for every gateway process of the host (:mod:`sluice.gateway.shm.store`), and
each process keeps a copy it reloads when the host's change counter moved. A system region
is (key, offset, byte_size) of a POSIX shm object on this host; tensors reference it by
region name with an offset and a size relative to the region. A CUDA region is an IPC
handle, opened in a process the first time that process needs it (the one that registers
it opens it to check it) and closed there when the region goes. System and CUDA regions
share one name space, as in Triton. Error messages start with Triton's own text where
Triton has one; Sluice's detail follows it.

A request resolves its references to (key, offset, size) when it is parsed, and holds a
lease on the regions it names while it runs (:meth:`RegionRegistry.hold`, see
:mod:`sluice.gateway.shm.leases`). As in Triton, unregistering a region that requests in
flight use answers at once but takes effect when the last of them ends, in every process of
the host: meanwhile the region stays listed, new requests may still name it, and its name
cannot be registered again. The request's deadline bounds the wait.

The key is checked when registered (a plain object: no link, see :func:`sluice.core.shm.opened`)
and again by whoever opens it for a request, since its owner may replace it meanwhile.

Regions belong to the tenant that registered them (:data:`sluice.core.tenants.CURRENT_TENANT`,
the caller's): each tenant has a name space of its own, and a tenant's registrations, status,
unregistrations and requests see its own regions alone, so that no tenant can read, write,
unregister or learn of another's (another's region is an unknown one). The host's records
name a region ``<tenant>/<name>`` (:func:`scoped`; a tenant name holds no ``/``). Without API
keys there is one tenant, and so one name space, as in Triton. With API keys, a tenant
registers at most ``SLUICE_TENANT_MAX_SHM_REGIONS`` regions on a host, so that it cannot take
the whole of the host's ``SLUICE_MAX_SHM_REGIONS`` from the others.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import itertools
import logging
import uuid
from dataclasses import dataclass
from typing import Any, TypeVar

import orjson

from sluice.core.errors import Forbidden, InvalidInput, NotFound, SluiceError
from sluice.core.settings import GatewaySettings
from sluice.core.shm import (
    ObjectTooSmall,
    ShmKeyError,
    UnsafeObject,
    object_name,
    opened,
    read_object,
    reserved_prefix,
    write_object,
)
from sluice.core.tenants import CURRENT_TENANT
from sluice.core.wire import ShmRef
from sluice.gateway.shm.cuda import CudaRegion, close_cuda_region, open_cuda_region
from sluice.gateway.shm.store import (
    ChangeCounter,
    LocalCounter,
    MemoryRegionStore,
    Records,
    RegionLimits,
    RegionStore,
    already_registered,
)

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class SystemRegion:
    name: str
    key: str
    offset: int
    byte_size: int

    def status(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "key": self.key,
            "offset": self.offset,
            "byte_size": self.byte_size,
        }


_LOOPBACK = ("127.0.0.1", "::1", "localhost")

MAX_NAME_BYTES = 255
"""The longest region name (UTF-8): a region's name is kept in Redis by every process of the
host and listed in every status, so it is bounded as a key is."""


def own_prefix() -> str:
    """The start of the calling tenant's region names in the host's records."""
    return f"{CURRENT_TENANT.get()}/"


def scoped(name: str) -> str:
    """Region ``name`` of the calling tenant, as the host's records name it."""
    return own_prefix() + name


def _check_name(name: str) -> None:
    try:
        size = len(name.encode())
    except UnicodeEncodeError:  # (a lone surrogate)
        size = MAX_NAME_BYTES + 1
    if not name or size > MAX_NAME_BYTES:
        shown = "an empty name" if not name else f"a name of {size} bytes"
        raise InvalidInput(
            f"cannot register shared memory region with {shown}: a region name has 1 to "
            f"{MAX_NAME_BYTES} bytes"
        )


CLIENT_SHM_DISABLED = (
    "Client shared memory is disabled. Start the server with '--allow-client-shm=true' to enable"
)
"""Triton's text when its --allow-client-shm is false; Sluice's switch follows it."""


def client_shm_refusal(settings: GatewaySettings) -> str:
    """Why this gateway refuses client shared memory ("" when it accepts it):
    SLUICE_ALLOW_CLIENT_SHM, or by default: accepted on loopback, or behind admin keys."""
    if settings.allow_client_shm is False:
        return f"{CLIENT_SHM_DISABLED}; this gateway was started with SLUICE_ALLOW_CLIENT_SHM=false"
    if settings.allow_client_shm or settings.http_host in _LOOPBACK:
        return ""
    if settings.admin_keys.strip() or settings.admin_keys_file:
        return ""
    return (
        f"this gateway does not accept client shared memory by default: it listens on "
        f"{settings.http_host}, beyond loopback, without admin keys (set admin keys, or "
        "SLUICE_ALLOW_CLIENT_SHM=true, to allow it)"
    )


def _keyed(settings: GatewaySettings) -> bool:
    """Whether API keys make tenants here (without them, the one tenant is bounded by the
    host's ``max_shm_regions`` alone, as before tenants had a bound of their own)."""
    return bool(
        settings.api_keys.strip()
        or settings.api_keys_file
        or settings.admin_keys.strip()
        or settings.admin_keys_file
    )


def client_shm_allowed(settings: GatewaySettings) -> bool:
    return not client_shm_refusal(settings)


class RegionMiss(InvalidInput):
    """A request named a region this process's copy does not hold, or the host's records
    changed since the copy was made: :meth:`RegionRegistry.catch_up`, then parse again
    (:func:`sluice.gateway.inference.data_plane.prepare_with` does). Uncaught, it is the
    request's 400."""


class RegionsChanged(RegionMiss):
    def __init__(self) -> None:
        super().__init__("the shared memory regions of this host changed meanwhile; retry")


@dataclass(frozen=True, slots=True)
class RegionUse:
    """One reference of a request to a region, as resolved when the request was parsed."""

    label: str
    """Whose reference (``input 'x'``, ``output 'y'``), for the errors."""
    region: str
    ref: ShmRef


@dataclass(frozen=True, slots=True)
class Lease:
    """What a request in flight holds on the regions it uses (:meth:`RegionRegistry.hold`)."""

    id: str
    names: list[str]


@dataclass(frozen=True, slots=True)
class CudaRecord:
    """A CUDA region as recorded for the host; each process opens the handle itself."""

    name: str
    raw_handle: bytes
    device_id: int
    byte_size: int

    def status(self) -> dict[str, Any]:
        return {"name": self.name, "device_id": self.device_id, "byte_size": self.byte_size}


class RegionRegistry:
    def __init__(
        self,
        allowed: bool = True,
        *,
        refusal: str = "",
        max_input_bytes: int | None = None,
        max_regions: int = 1024,
        tenant_max_regions: int = 256,
        store: RegionStore | None = None,
        counter: ChangeCounter | None = None,
        host: str = "",
    ) -> None:
        """``allowed``: whether clients may register regions at all (``refusal`` says why
        not). ``max_input_bytes``: the largest input a request may take from a region (the
        gateway's body limit); outputs are limited by their region. ``max_regions``: the
        most regions of the host at once; ``tenant_max_regions``: the most of one tenant's
        among them. ``store`` and ``counter``: where the host's
        records are and what tells of their changes (default: this process alone);
        ``host``: the host id they belong to."""
        self.allowed = allowed and not refusal
        self.refusal = refusal or "client shared memory is disabled on this gateway"
        self.max_input_bytes = max_input_bytes
        self.limits = RegionLimits(host=max_regions, tenant=tenant_max_regions)
        self.store: RegionStore = store if store is not None else MemoryRegionStore()
        self.counter: ChangeCounter = counter if counter is not None else LocalCounter()
        self.host = host
        self.system: dict[str, SystemRegion] = {}
        self.cuda: dict[str, CudaRecord] = {}
        """The host's regions by their records' names (:func:`scoped`: every tenant's)."""
        self.records = Records(-1)
        """The host's records as loaded (the copy's source; :meth:`hold` compares them)."""
        self.opened: dict[str, tuple[CudaRecord, CudaRegion]] = {}
        """CUDA handles opened in this process, with the record each was opened from."""
        self.revision: int | None = None
        """The revision of the records the copy holds (None: none loaded yet)."""
        self.seen = self.counter.value()
        """The host's change counter when the copy was loaded."""
        self._loading = asyncio.Lock()
        self._lease_ids = (f"{uuid.uuid4().hex[:12]}:{n}" for n in itertools.count())
        """Lease ids unique to this process (a lease is one request's)."""

    @classmethod
    def from_settings(
        cls,
        settings: GatewaySettings,
        store: RegionStore | None = None,
        counter: ChangeCounter | None = None,
        host: str = "",
    ) -> RegionRegistry:
        return cls(
            refusal=client_shm_refusal(settings),
            max_input_bytes=settings.max_body_bytes,
            max_regions=settings.max_shm_regions,
            tenant_max_regions=(
                settings.tenant_max_shm_regions if _keyed(settings) else settings.max_shm_regions
            ),
            store=store,
            counter=counter,
            host=host,
        )

    # -- the copy of the host's records ----------------------------------------------------

    async def catch_up(self) -> bool:
        """Load the host's records when they changed (one Redis round trip when they did
        not, which also renews them); whether the copy changed."""
        async with self._loading:
            seen = self.counter.value()
            records = await self.store.load(self.revision)
            self.seen = seen
            if records is None:
                return False
            self._take(records)
            return True

    async def recover(self, miss: RegionMiss) -> bool:
        """After a request's :class:`RegionMiss`: catch up; whether parsing it again may
        find what it missed (the copy changed, or was behind the counter)."""
        changed = await self.catch_up()
        return changed or isinstance(miss, RegionsChanged)

    def _take(self, records: Records) -> None:
        self.system = {
            name: _system_region(name, record) for name, record in records.system.items()
        }
        self.cuda = {name: _cuda_record(name, record) for name, record in records.cuda.items()}
        self.records = records
        self.revision = records.revision
        for name, (record, region) in list(self.opened.items()):
            if self.cuda.get(name) != record:  # unregistered, or registered anew
                del self.opened[name]
                _close_quietly(region)

    async def _changed(self) -> None:
        """After a change of the records: tell the host's other processes, reload."""
        self.counter.bump()
        await self.catch_up()

    def close_local(self) -> None:
        """Close the CUDA handles this process opened (it stops; the records stay)."""
        opened, self.opened = self.opened, {}
        for _, region in opened.values():
            _close_quietly(region)

    # -- registration ----------------------------------------------------------------------

    def system_bytes(self) -> int:
        """Bytes of the system shared memory regions registered on this host."""
        return sum(region.byte_size for region in self.system.values())

    def host_tag(self) -> int:
        """A number for the host (its id's digest): the processes of one host report the
        same regions, which a sum over the gateways must count once per host."""
        return int.from_bytes(hashlib.sha256(self.host.encode()).digest()[:6], "big")

    async def register_system(self, name: str, key: str, offset: int, byte_size: int) -> None:
        self._check_allowed()
        _check_name(name)
        try:
            object_name(key)
        except ShmKeyError as exc:
            raise _invalid_key(name, key, exc) from None
        prefix = reserved_prefix(key)
        if prefix:
            owner = "Sluice's own segments" if prefix.startswith("sluice") else "Triton's"
            raise InvalidInput(
                f"cannot register shared memory region '{name}' with key '{key}' as the key "
                f"contains the reserved prefix '{prefix}' ({owner})"
            )
        await self.catch_up()
        self._check_free(name)
        unable = f"Unable to open shared memory region: '{key}'"
        try:
            with opened(key, writable=True) as (_, status):
                size = status.st_size
        except FileNotFoundError:
            raise InvalidInput(f"{unable}: no such object on the gateway's host") from None
        except UnsafeObject as exc:
            raise InvalidInput(
                f"{unable}: {exc}; a region must be a plain shared memory object"
            ) from None
        except ShmKeyError as exc:
            raise _invalid_key(name, key, exc) from None
        except OSError as exc:
            raise InvalidInput(f"{unable}: {exc.strerror or exc}") from None
        if offset + byte_size > size:
            raise InvalidInput(
                f"failed to register shared memory region '{name}': invalid args: offset "
                f"{offset} + byte_size {byte_size} exceeds the {size} bytes of shared memory "
                f"key '{key}'"
            )
        record = {"key": key, "offset": offset, "byte_size": byte_size}
        await self.store.add("system", scoped(name), orjson.dumps(record), self.limits)
        await self._changed()

    async def register_cuda(
        self, name: str, raw_handle: bytes, device_id: int, byte_size: int
    ) -> None:
        """Opens the handle here first: that proves it (Triton's errors otherwise)."""
        self._check_allowed()
        _check_name(name)
        await self.catch_up()
        self._check_free(name)
        region = open_cuda_region(name, raw_handle, device_id, byte_size)
        record = CudaRecord(name, raw_handle, device_id, byte_size)
        field = scoped(name)
        try:
            await self.store.add("cuda", field, _cuda_json(record), self.limits)
        except BaseException:
            _close_quietly(region)
            raise
        previous = self.opened.pop(field, None)
        if previous is not None:
            _close_quietly(previous[1])
        self.opened[field] = (record, region)
        await self._changed()

    def mapped_cuda(self, name: str) -> CudaRegion:
        """Region ``name``'s handle opened in this process (opened now, the first time)."""
        field = scoped(name)
        record = self.cuda.get(field)
        if record is None:
            raise InvalidInput(f"Unable to find cuda shared memory region: '{name}'")
        held = self.opened.get(field)
        if held is not None and held[0] == record:
            return held[1]
        region = open_cuda_region(name, record.raw_handle, record.device_id, record.byte_size)
        self.opened[field] = (record, region)
        return region

    def _check_allowed(self) -> None:
        if not self.allowed:
            raise Forbidden(self.refusal)

    def _check_free(self, name: str) -> None:
        field = scoped(name)
        if field in self.system or field in self.cuda:
            raise already_registered(name, draining=field in self.records.draining)

    async def unregister_system(self, name: str | None) -> None:
        """The calling tenant's region ``name`` (None: all of its regions), in every process
        of the host; an unknown name is no error. As Triton, a region that requests in
        flight use stays (listed, usable, its name taken) until the last of them ends, and
        the call answers at once all the same."""
        await self.store.remove("system", None if name is None else scoped(name), own_prefix())
        await self._changed()

    async def unregister_cuda(self, name: str | None) -> None:
        """As :meth:`unregister_system`; each process closes the handles it opened."""
        await self.store.remove("cuda", None if name is None else scoped(name), own_prefix())
        await self._changed()

    # -- requests in flight ----------------------------------------------------------------

    async def hold(self, uses: list[RegionUse], timeout_s: float) -> Lease | None:
        """Lease the regions a parsed request uses, for its time left ``timeout_s`` at most:
        unregistered meanwhile, they stay until :meth:`release` (None: it uses none). A
        region that went (or was registered anew) since the request was parsed is the
        request's 400, as it would have been a moment later."""
        if not uses:
            return None
        if self.counter.value() != self.seen:
            await self.catch_up()
        records: dict[str, bytes] = {}
        for use in uses:
            field = scoped(use.region)
            record = self._record_holding(field, use)
            if record is None:
                raise _gone(use)
            records[field] = record
        lease = Lease(next(self._lease_ids), list(records))
        missing = await self.store.hold(records, lease.id, max(1, int(timeout_s * 1000)))
        if missing is not None:
            await self.catch_up()
            raise _gone(next(use for use in uses if scoped(use.region) == missing))
        return lease

    def _record_holding(self, field: str, use: RegionUse) -> bytes | None:
        """The record ``field`` (region ``use.region``) in the copy, if it still holds the
        bytes the request resolved."""
        region = self.system.get(field)
        if region is None or region.key != use.ref.key:
            return None
        start = use.ref.offset - region.offset
        if start < 0 or start + use.ref.byte_size > region.byte_size:
            return None
        return self.records.system.get(field)

    async def release(self, lease: Lease) -> None:
        """The request ended: a draining region whose last user it was goes now, in every
        process of the host."""
        if await self.store.release(lease.names, lease.id):
            await self._changed()

    async def system_status(self, name: str | None) -> list[dict[str, Any]]:
        """The calling tenant's system regions (``name``: that one alone)."""
        await self.catch_up()
        system, cuda = _own(self.system), _own(self.cuda)
        return [r.status() for r in self._select(system, cuda, name, "system", "CUDA")]

    async def cuda_status(self, name: str | None) -> list[dict[str, Any]]:
        """The calling tenant's CUDA regions (``name``: that one alone)."""
        await self.catch_up()
        system, cuda = _own(self.system), _own(self.cuda)
        return [r.status() for r in self._select(cuda, system, name, "cuda", "system")]

    @staticmethod
    def _select(
        regions: dict[str, Any], others: dict[str, Any], name: str | None, kind: str, other: str
    ) -> list[Any]:
        if name is None:
            return list(regions.values())
        if name in others:
            this = "CUDA" if kind == "cuda" else kind
            raise NotFound(
                f"The region named '{name}' is registered as {other} shared memory, not {this} "
                "shared memory"
            )
        if name not in regions:
            raise NotFound(f"Unable to find {kind} shared memory region: '{name}'")
        return [regions[name]]

    # -- use by requests -------------------------------------------------------------------

    def resolve(
        self, label: str, name: str, offset: int, byte_size: int, *, output: bool = False
    ) -> ShmRef:
        """Where ``byte_size`` bytes at ``offset`` of the calling tenant's region ``name``
        are; 400 if they are not. An input (not ``output``) may not be larger than
        ``max_input_bytes``. :class:`RegionMiss` when the copy may be behind: the host's
        records changed, or the name is not in it."""
        if self.counter.value() != self.seen:
            raise RegionsChanged()
        field = scoped(name)
        region = self.system.get(field)
        if region is None:
            if field in self.cuda:
                raise InvalidInput(
                    f"{label}: CUDA shared memory region '{name}' cannot carry tensors yet; "
                    "use a system shared memory region"
                )
            raise RegionMiss(f"{label}: unknown shared memory region '{name}'")
        size = region.byte_size
        if offset > size or (offset == size and byte_size):
            raise InvalidInput(
                f"Invalid offset for shared memory region: '{name}'; {label}: shared memory "
                f"offset {offset} is beyond the {size} bytes of the region"
            )
        if offset + byte_size > size:
            raise InvalidInput(
                f"Invalid offset + byte size for shared memory region: '{name}'; {label}: "
                f"shared memory offset {offset} + byte size {byte_size} is beyond the {size} "
                f"bytes of region '{name}'"
            )
        limit = self.max_input_bytes
        if not output and limit is not None and byte_size > limit:
            raise InvalidInput(
                f"{label}: {byte_size} bytes in shared memory region '{name}' exceed the "
                f"gateway's limit of {limit} bytes per input (SLUICE_MAX_BODY_BYTES)"
            )
        return ShmRef(region.key, region.offset + offset, byte_size)

    @staticmethod
    def read(label: str, region: str, ref: ShmRef) -> memoryview:
        """A copy of the referenced bytes for the gateway's own use (BYTES validation,
        several hosts): ``pread``, never a mapping, so a client that shrinks its object
        fails this request and nothing else. Blocking and touching no registry state:
        call it from a worker thread when the bytes are many."""
        try:
            return read_object(ref.key, ref.offset, ref.byte_size)
        except (OSError, ValueError) as exc:
            raise _refused(label, region, ref, exc) from None

    @staticmethod
    def write(label: str, region: str, ref: ShmRef, data: bytes | memoryview) -> None:
        """Copy ``data`` to the start of the referenced bytes (``pwrite``)."""
        try:
            write_object(ref.key, ref.offset, data)
        except (OSError, ValueError) as exc:
            raise _refused(label, region, ref, exc) from None


def _gone(use: RegionUse) -> InvalidInput:
    return InvalidInput(
        f"{use.label}: unknown shared memory region '{use.region}' (it was unregistered, or "
        "registered anew, while the request was read)"
    )


def _invalid_key(name: str, key: str, exc: ShmKeyError) -> InvalidInput:
    return InvalidInput(
        f"cannot register shared memory region '{name}' - invalid shm key '{key}'; {exc}"
    )


def _refused(label: str, region: str, ref: ShmRef, exc: OSError | ValueError) -> InvalidInput:
    where = f"shared memory key '{ref.key}' of region '{region}'"
    if isinstance(exc, FileNotFoundError):
        return InvalidInput(f"{label}: {where} no longer exists")
    if isinstance(exc, ObjectTooSmall | UnsafeObject | ShmKeyError):
        return InvalidInput(f"{label}: {where} is refused: {exc}")
    detail = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    return InvalidInput(f"{label}: cannot use {where}: {detail}")


def _own(regions: dict[str, T]) -> dict[str, T]:
    """The calling tenant's ``regions``, by their names."""
    prefix = own_prefix()
    return {field[len(prefix) :]: r for field, r in regions.items() if field.startswith(prefix)}


def _name(field: str) -> str:
    """A region's name from its record's (:func:`scoped`)."""
    return field.partition("/")[2]


def _system_region(field: str, record: bytes) -> SystemRegion:
    fields = orjson.loads(record)
    return SystemRegion(_name(field), fields["key"], fields["offset"], fields["byte_size"])


def _cuda_json(record: CudaRecord) -> bytes:
    handle = base64.b64encode(record.raw_handle).decode()
    return orjson.dumps(
        {"raw_handle": handle, "device_id": record.device_id, "byte_size": record.byte_size}
    )


def _cuda_record(field: str, record: bytes) -> CudaRecord:
    fields = orjson.loads(record)
    handle = base64.b64decode(fields["raw_handle"])
    return CudaRecord(_name(field), handle, fields["device_id"], fields["byte_size"])


def _close_quietly(region: CudaRegion) -> None:
    try:
        close_cuda_region(region)
    except SluiceError as exc:
        log.warning("closing CUDA shared memory region '%s' failed: %s", region.name, exc.message)
