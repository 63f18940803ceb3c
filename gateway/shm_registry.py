"""Shared memory regions registered with this gateway (Triton's system and CUDA extensions).

Regions live per gateway process, as they do per Triton server. A system region is
(key, offset, byte_size) of a POSIX shm object on this host; tensors reference it by
region name with an offset and a size relative to the region. System and CUDA regions
share one name space, as in Triton. Error messages start with Triton's own text where
Triton has one; Sluice's detail follows it.

A request resolves its references to (key, offset, size) when it is parsed and needs
the registry no more, so unregistering a region takes effect at once, even while
requests that resolved it are in flight: they finish normally, new requests can no
longer name it, and the name can be registered again.

The key is checked when registered (a plain object: no link, see :func:`sluice.core.shm.opened`)
and again by whoever opens it for a request, since its owner may replace it meanwhile.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sluice.core.errors import Forbidden, InvalidInput, NotFound, Unsupported
from sluice.core.settings import GatewaySettings
from sluice.core.shm import (
    ObjectTooSmall,
    ShmKeyError,
    UnsafeObject,
    opened,
    read_object,
    reserved_prefix,
    write_object,
)
from sluice.core.wire import ShmRef
from sluice.gateway.cuda_shm import CudaRegion, close_cuda_region, open_cuda_region


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


def client_shm_refusal(settings: GatewaySettings) -> str:
    """Why this gateway refuses client shared memory ("" when it accepts it):
    SLUICE_ALLOW_CLIENT_SHM, or by default: accepted on loopback, or behind admin keys."""
    if settings.allow_client_shm is False:
        return "client shared memory is disabled on this gateway (SLUICE_ALLOW_CLIENT_SHM=false)"
    if settings.allow_client_shm or settings.http_host in _LOOPBACK:
        return ""
    if settings.admin_keys.strip() or settings.admin_keys_file:
        return ""
    return (
        f"this gateway does not accept client shared memory by default: it listens on "
        f"{settings.http_host}, beyond loopback, without admin keys (set admin keys, or "
        "SLUICE_ALLOW_CLIENT_SHM=true, to allow it)"
    )


def client_shm_allowed(settings: GatewaySettings) -> bool:
    return not client_shm_refusal(settings)


class RegionRegistry:
    def __init__(
        self,
        allowed: bool = True,
        gateway_processes: int = 1,
        *,
        refusal: str = "",
        max_input_bytes: int | None = None,
    ) -> None:
        """``allowed``: whether clients may register regions at all (``refusal`` says why
        not). Regions live in one gateway process, so with several processes sharing the
        port a request could reach one that never saw the registration: registering is
        refused there, clearly. ``max_input_bytes``: the largest input a request may take
        from a region (the gateway's body limit); outputs are limited by their region."""
        self.allowed = allowed and not refusal
        self.refusal = refusal or "client shared memory is disabled on this gateway"
        self.gateway_processes = gateway_processes
        self.max_input_bytes = max_input_bytes
        self.system: dict[str, SystemRegion] = {}
        self.cuda: dict[str, CudaRegion] = {}

    @classmethod
    def from_settings(cls, settings: GatewaySettings) -> RegionRegistry:
        return cls(
            gateway_processes=settings.gateway_processes,
            refusal=client_shm_refusal(settings),
            max_input_bytes=settings.max_body_bytes,
        )

    # -- registration ----------------------------------------------------------------------

    def _check_single_process(self) -> None:
        if self.gateway_processes > 1:
            raise Unsupported(
                f"shared memory regions cannot be registered while {self.gateway_processes} "
                "gateway processes share the port (regions live in one process); "
                "run with --gateway-processes 1"
            )

    def system_bytes(self) -> int:
        """Bytes of the system shared memory regions registered here."""
        return sum(region.byte_size for region in self.system.values())

    def register_system(self, name: str, key: str, offset: int, byte_size: int) -> None:
        self._check_allowed()
        self._check_single_process()
        prefix = reserved_prefix(key)
        if prefix:
            owner = "Sluice's own segments" if prefix.startswith("sluice") else "Triton's"
            raise InvalidInput(
                f"cannot register shared memory region '{name}' with key '{key}' as the key "
                f"contains the reserved prefix '{prefix}' ({owner})"
            )
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
            raise InvalidInput(f"{unable}: {exc}") from None
        except OSError as exc:
            raise InvalidInput(f"{unable}: {exc.strerror or exc}") from None
        if offset + byte_size > size:
            raise InvalidInput(
                f"failed to register shared memory region '{name}': invalid args: offset "
                f"{offset} + byte_size {byte_size} exceeds the {size} bytes of shared memory "
                f"key '{key}'"
            )
        self.system[name] = SystemRegion(name, key, offset, byte_size)

    def register_cuda(self, name: str, raw_handle: bytes, device_id: int, byte_size: int) -> None:
        self._check_allowed()
        self._check_single_process()
        self._check_free(name)
        self.cuda[name] = open_cuda_region(name, raw_handle, device_id, byte_size)

    def _check_allowed(self) -> None:
        if not self.allowed:
            raise Forbidden(self.refusal)

    def _check_free(self, name: str) -> None:
        if name in self.system or name in self.cuda:
            raise InvalidInput(f"shared memory region '{name}' already in manager")

    def unregister_system(self, name: str | None) -> None:
        """At once (as Triton, requests in flight keep what they resolved); an unknown
        name is no error."""
        for region in self._take(self.system, name):
            del self.system[region.name]

    def unregister_cuda(self, name: str | None) -> None:
        for region in self._take(self.cuda, name):
            del self.cuda[region.name]
            close_cuda_region(region)

    @staticmethod
    def _take(regions: dict[str, Any], name: str | None) -> list[Any]:
        names = list(regions) if name is None else [name] if name in regions else []
        return [regions[n] for n in names]

    def system_status(self, name: str | None) -> list[dict[str, Any]]:
        return [r.status() for r in self._select(self.system, self.cuda, name, "system", "CUDA")]

    def cuda_status(self, name: str | None) -> list[dict[str, Any]]:
        return [r.status() for r in self._select(self.cuda, self.system, name, "cuda", "system")]

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
        """Where ``byte_size`` bytes at ``offset`` of region ``name`` are; 400 if they are
        not. An input (not ``output``) may not be larger than ``max_input_bytes``."""
        region = self.system.get(name)
        if region is None:
            if name in self.cuda:
                raise InvalidInput(
                    f"{label}: CUDA shared memory region '{name}' cannot carry tensors yet; "
                    "use a system shared memory region"
                )
            raise InvalidInput(f"{label}: unknown shared memory region '{name}'")
        if offset + byte_size > region.byte_size:
            raise InvalidInput(
                f"{label}: shared memory offset {offset} + byte size {byte_size} is beyond "
                f"the {region.byte_size} bytes of region '{name}'"
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


def _refused(label: str, region: str, ref: ShmRef, exc: OSError | ValueError) -> InvalidInput:
    where = f"shared memory key '{ref.key}' of region '{region}'"
    if isinstance(exc, FileNotFoundError):
        return InvalidInput(f"{label}: {where} no longer exists")
    if isinstance(exc, ObjectTooSmall | UnsafeObject | ShmKeyError):
        return InvalidInput(f"{label}: {where} is refused: {exc}")
    detail = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    return InvalidInput(f"{label}: cannot use {where}: {detail}")
