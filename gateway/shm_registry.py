"""Shared memory regions registered with this gateway (Triton's system and CUDA extensions).

Regions live per gateway process, as they do per Triton server. A system region is
(key, offset, byte_size) of a POSIX shm object on this host; tensors reference it by
region name with an offset and a size relative to the region. System and CUDA regions
share one name space, as in Triton. A region used by an in-flight request cannot be
unregistered (400 "in use") until that request ends.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

from gateway.cuda_shm import CudaRegion, close_cuda_region, open_cuda_region
from sluice.errors import Forbidden, InvalidInput, NotFound, Unsupported
from sluice.settings import GatewaySettings
from sluice.shm import ShmKeyError, close_quietly, is_reserved, map_object, object_path
from sluice.wire import ShmRef


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


def client_shm_allowed(settings: GatewaySettings) -> bool:
    """SLUICE_ALLOW_CLIENT_SHM, or by default: on loopback, or behind admin keys."""
    if settings.allow_client_shm is not None:
        return settings.allow_client_shm
    loopback = settings.http_host in ("127.0.0.1", "::1", "localhost")
    return loopback or bool(settings.admin_keys.strip() or settings.admin_keys_file)


class _Held:
    """Use counts of the regions one request references (a class: cheaper than a generator)."""

    __slots__ = ("counts", "names")

    def __init__(self, counts: Counter[str], names: list[str]) -> None:
        self.counts, self.names = counts, names

    def __enter__(self) -> None:
        self.counts.update(self.names)

    def __exit__(self, *_: object) -> None:
        self.counts.subtract(self.names)
        for name in self.names:
            if self.counts[name] <= 0:
                del self.counts[name]


_NOTHING = nullcontext()


class RegionRegistry:
    def __init__(self, allowed: bool = True, gateway_processes: int = 1) -> None:
        """``allowed``: whether clients may register regions at all. Regions live in one
        gateway process, so with several processes sharing the port a request could reach
        one that never saw the registration: registering is refused there, clearly."""
        self.allowed = allowed
        self.gateway_processes = gateway_processes
        self.system: dict[str, SystemRegion] = {}
        self.cuda: dict[str, CudaRegion] = {}
        self._in_use: Counter[str] = Counter()

    # -- registration ----------------------------------------------------------------------

    def _check_single_process(self) -> None:
        if self.gateway_processes > 1:
            raise Unsupported(
                f"shared memory regions cannot be registered while {self.gateway_processes} "
                "gateway processes share the port (regions live in one process); "
                "run with --gateway-processes 1"
            )

    def register_system(self, name: str, key: str, offset: int, byte_size: int) -> None:
        self._check_single_process()
        self._check_free(name)
        if is_reserved(key):
            raise InvalidInput(
                f"shared memory key '{key}' is reserved: keys starting with 'sluice-' name "
                "Sluice's own segments"
            )
        try:
            path = object_path(key)
            fd = os.open(path, os.O_RDWR)
        except ShmKeyError as exc:
            raise InvalidInput(f"cannot register region '{name}': {exc}") from None
        except FileNotFoundError:
            raise InvalidInput(
                f"cannot register region '{name}': shared memory key '{key}' does not exist "
                f"on the gateway's host (no {path})"
            ) from None
        except OSError as exc:
            raise InvalidInput(
                f"cannot register region '{name}': cannot open shared memory key '{key}': "
                f"{exc.strerror}"
            ) from None
        try:
            size = os.fstat(fd).st_size
        finally:
            os.close(fd)
        if offset + byte_size > size:
            raise InvalidInput(
                f"cannot register region '{name}': offset {offset} + byte_size {byte_size} "
                f"exceeds the {size} bytes of shared memory key '{key}'"
            )
        self.system[name] = SystemRegion(name, key, offset, byte_size)

    def register_cuda(self, name: str, raw_handle: bytes, device_id: int, byte_size: int) -> None:
        self._check_single_process()
        self._check_free(name)
        self.cuda[name] = open_cuda_region(name, raw_handle, device_id, byte_size)

    def _check_free(self, name: str) -> None:
        if not self.allowed:
            raise Forbidden(
                "this gateway does not accept client shared memory: it listens beyond "
                "loopback without admin keys (set SLUICE_ALLOW_CLIENT_SHM=true to allow it)"
            )
        if name in self.system or name in self.cuda:
            raise InvalidInput(f"shared memory region '{name}' is already registered")

    def unregister_system(self, name: str | None) -> None:
        for region in self._take(self.system, name):
            del self.system[region.name]

    def unregister_cuda(self, name: str | None) -> None:
        for region in self._take(self.cuda, name):
            del self.cuda[region.name]
            close_cuda_region(region)

    def _take(self, regions: dict[str, Any], name: str | None) -> list[Any]:
        """The regions to unregister (none for an unknown name, as Triton); 400 if in use."""
        names = list(regions) if name is None else [name] if name in regions else []
        busy = [n for n in names if self._in_use[n]]
        if busy:
            listed = ", ".join(f"'{n}' ({self._in_use[n]} requests)" for n in busy)
            raise InvalidInput(
                f"shared memory region in use by in-flight requests: {listed}; "
                "unregister it once they have finished"
            )
        return [regions[n] for n in names]

    def system_status(self, name: str | None) -> list[dict[str, Any]]:
        return [r.status() for r in self._select(self.system, name, "system")]

    def cuda_status(self, name: str | None) -> list[dict[str, Any]]:
        return [r.status() for r in self._select(self.cuda, name, "CUDA")]

    @staticmethod
    def _select(regions: dict[str, Any], name: str | None, kind: str) -> list[Any]:
        if name is None:
            return list(regions.values())
        if name not in regions:
            raise NotFound(f"no {kind} shared memory region '{name}' is registered")
        return [regions[name]]

    # -- use by requests -------------------------------------------------------------------

    def resolve(self, label: str, name: str, offset: int, byte_size: int) -> ShmRef:
        """Where ``byte_size`` bytes at ``offset`` of region ``name`` are; 400 if they are not."""
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
        return ShmRef(region.key, region.offset + offset, byte_size)

    def in_use(self, names: list[str]) -> AbstractContextManager[None]:
        """Hold the regions for the duration of one request."""
        return _Held(self._in_use, names) if names else _NOTHING

    @contextmanager
    def mapped(self, label: str, region: str, ref: ShmRef) -> Iterator[memoryview]:
        """The referenced bytes, mapped for the gateway's own use (validation, several hosts)."""
        if ref.byte_size == 0:
            yield memoryview(bytearray())
            return
        try:
            mapping, _ = map_object(ref.key, writable=True)
        except (OSError, ValueError) as exc:
            raise InvalidInput(
                f"{label}: cannot map shared memory key '{ref.key}' of region '{region}': {exc}"
            ) from None
        try:
            end = ref.offset + ref.byte_size
            if end > len(mapping):
                raise InvalidInput(
                    f"{label}: region '{region}' reaches byte {end} of shared memory key "
                    f"'{ref.key}', which now holds only {len(mapping)} bytes"
                )
            view = memoryview(mapping)[ref.offset : end]
            try:
                yield view
            finally:
                view.release()
        finally:
            close_quietly(mapping)
