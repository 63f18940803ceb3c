"""Shared memory as the worker sees it: the keys its stream entries name.

Client objects (registered regions) are mapped once and kept, least recently used
first out (a mapping is closed on eviction, or as soon as the last array using it is
gone); one that was replaced under the same key (another inode or size) is mapped
again. A gateway's input segment lives for one request, so it is mapped without
caching and unmapped with the arrays that use it. Everything here is thread-safe:
entries are checked on the event loop, tensors read and written on the compute thread.
"""

from __future__ import annotations

import mmap
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from sluice.errors import InvalidInput
from sluice.shm import SHM_DIR, close_quietly, map_object, object_path
from sluice.wire import ShmRef

MAX_MAPPINGS = 64
"""Client objects kept mapped per worker process."""


@dataclass(slots=True)
class _Mapped:
    mapping: mmap.mmap
    identity: tuple[int, int]
    size: int


class Mappings:
    def __init__(self, capacity: int = MAX_MAPPINGS, directory: Path = SHM_DIR) -> None:
        self.capacity = capacity
        self.directory = directory
        self._cache: OrderedDict[str, _Mapped] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._cache)

    def _stat(self, ref: ShmRef, what: str) -> os.stat_result:
        try:
            status = os.stat(object_path(ref.key, self.directory))
        except FileNotFoundError:
            raise InvalidInput(
                f"{what}: shared memory key '{ref.key}' does not exist on the worker's host"
            ) from None
        except OSError as exc:
            raise InvalidInput(
                f"{what}: cannot open shared memory key '{ref.key}': {exc.strerror}"
            ) from None
        end = ref.offset + ref.byte_size
        if end > status.st_size:
            raise InvalidInput(
                f"{what}: shared memory key '{ref.key}' holds {status.st_size} bytes, "
                f"the tensor reaches byte {end}"
            )
        return status

    def check(self, ref: ShmRef, what: str) -> None:
        """The referenced bytes exist (cheap: no mapping)."""
        self._stat(ref, what)

    def view(self, ref: ShmRef, what: str) -> memoryview:
        """Writable view of a client object's referenced bytes, through the cache."""
        status = self._stat(ref, what)
        if ref.byte_size == 0:
            return memoryview(bytearray())
        identity = (status.st_dev, status.st_ino)
        with self._lock:
            cached = self._cache.get(ref.key)
            if cached is None or cached.identity != identity or cached.size != status.st_size:
                if cached is not None:
                    close_quietly(self._cache.pop(ref.key).mapping)
                cached = self._map(ref, what)
                self._cache[ref.key] = cached
                while len(self._cache) > self.capacity:
                    _, evicted = self._cache.popitem(last=False)
                    close_quietly(evicted.mapping)
            else:
                self._cache.move_to_end(ref.key)
            return memoryview(cached.mapping)[ref.offset : ref.offset + ref.byte_size]

    def _map(self, ref: ShmRef, what: str) -> _Mapped:
        try:
            mapping, identity = map_object(ref.key, writable=True, directory=self.directory)
        except (OSError, ValueError) as exc:
            raise InvalidInput(f"{what}: cannot map shared memory key '{ref.key}': {exc}") from None
        return _Mapped(mapping, identity, len(mapping))

    def segment_view(self, ref: ShmRef, what: str) -> memoryview:
        """Read-only view of a one-request segment, unmapped when the view is gone."""
        self._stat(ref, what)
        if ref.byte_size == 0:
            return memoryview(b"")
        try:
            mapping, _ = map_object(ref.key, directory=self.directory)
        except (OSError, ValueError) as exc:
            raise InvalidInput(f"{what}: cannot map segment '{ref.key}': {exc}") from None
        return memoryview(mapping)[ref.offset : ref.offset + ref.byte_size]  # keeps it mapped

    def close(self) -> None:
        with self._lock:
            for cached in self._cache.values():
                close_quietly(cached.mapping)
            self._cache.clear()


MAPPINGS = Mappings()
"""The worker process's mappings (one model instance per process)."""


def input_view(ref: ShmRef, segment_prefix: str, what: str) -> memoryview:
    """The bytes of an input passed by reference: a gateway segment or a client region."""
    if segment_prefix and ref.key.lstrip("/").startswith(segment_prefix):
        return MAPPINGS.segment_view(ref, what)
    return MAPPINGS.view(ref, what)


def write(ref: ShmRef, data: bytes | memoryview, what: str) -> None:
    """Copy ``data`` to the start of the referenced bytes of a client region."""
    view = MAPPINGS.view(ref, what)
    source = memoryview(data).cast("B")
    view[: source.nbytes] = source
