"""Shared memory as the worker sees it: the keys its stream entries name.

A client's object (a registered region) is opened anew for every use, with
``O_NOFOLLOW``, and its bytes are copied with ``pread``/``pwrite``
(:mod:`sluice.core.shm`): the key may have been replaced by a link since the gateway
registered it, and the object may shrink at any moment, which through a mapping would
kill this process (SIGBUS) and with it every request of the batch. So an input in a
client region costs one copy into a fresh buffer, and a region that is no longer fit
fails only the request that uses it (400). Opening costs a few microseconds per tensor;
a cache of descriptors would save that and add staleness to reason about.

A gateway's input segment (Sluice's own, for one request) is mapped read-only, and
unmapped with the arrays that use it. Everything here is thread-safe: entries are
checked on the event loop, tensors read and written on the compute thread.
"""

from __future__ import annotations

from pathlib import Path

from sluice.core.errors import InvalidInput
from sluice.core.shm import (
    SHM_DIR,
    ObjectTooSmall,
    ShmKeyError,
    UnsafeObject,
    check_object,
    map_segment,
    read_object,
    write_object,
)
from sluice.core.wire import ShmRef


class SharedObjects:
    """Access to the shared memory objects of this host, one call at a time."""

    def __init__(self, directory: Path = SHM_DIR, host: str = "") -> None:
        self.directory = directory
        self.host = host
        """This worker's host id (:mod:`sluice.core.hosts`), set when the worker starts."""

    def elsewhere(self, message_host: str) -> bool:
        """Whether a request that may use shared memory came from a gateway on another
        host (a worker joined from elsewhere after the gateway chose shared memory)."""
        return bool(message_host and self.host and message_host != self.host)

    def check(self, ref: ShmRef, what: str) -> None:
        """The referenced bytes exist now (cheap: open, fstat, close)."""
        try:
            check_object(ref.key, ref.offset, ref.byte_size, directory=self.directory)
        except (OSError, ValueError) as exc:
            raise _refused(what, ref, exc) from None

    def read(self, ref: ShmRef, what: str) -> memoryview:
        """A copy of a client object's referenced bytes."""
        try:
            return read_object(ref.key, ref.offset, ref.byte_size, directory=self.directory)
        except (OSError, ValueError) as exc:
            raise _refused(what, ref, exc) from None

    def write(self, ref: ShmRef, data: bytes | memoryview, what: str) -> None:
        """Copy ``data`` to the start of a client object's referenced bytes."""
        try:
            write_object(ref.key, ref.offset, data, directory=self.directory)
        except (OSError, ValueError) as exc:
            raise _refused(what, ref, exc) from None

    def segment_view(self, ref: ShmRef, what: str) -> memoryview:
        """Read-only view of a one-request segment, unmapped when the view is gone."""
        if ref.byte_size == 0:
            return memoryview(b"")
        try:
            mapping = map_segment(ref.key, directory=self.directory)
        except (OSError, ValueError) as exc:
            raise InvalidInput(f"{what}: cannot map segment '{ref.key}': {exc}") from None
        end = ref.offset + ref.byte_size
        if end > len(mapping):
            mapping.close()
            raise InvalidInput(f"{what}: segment '{ref.key}' is shorter than byte {end}")
        return memoryview(mapping)[ref.offset : end]  # keeps it mapped


def _refused(what: str, ref: ShmRef, exc: OSError | ValueError) -> InvalidInput:
    key = ref.key
    if isinstance(exc, FileNotFoundError):
        return InvalidInput(
            f"{what}: shared memory key '{key}' does not exist on the worker's host"
        )
    if isinstance(exc, ObjectTooSmall):
        return InvalidInput(f"{what}: shared memory key '{key}': {exc}")
    if isinstance(exc, UnsafeObject | ShmKeyError):
        return InvalidInput(f"{what}: shared memory key '{key}' is refused: {exc}")
    detail = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    return InvalidInput(f"{what}: cannot use shared memory key '{key}': {detail}")


MAPPINGS = SharedObjects()
"""The worker process's access to shared memory (the name :mod:`sluice.workers.tensors` uses)."""


def input_view(ref: ShmRef, segment_prefix: str, what: str) -> memoryview:
    """The bytes of an input passed by reference: a gateway segment or a client region."""
    if segment_prefix and ref.key.lstrip("/").startswith(segment_prefix):
        return MAPPINGS.segment_view(ref, what)
    return MAPPINGS.read(ref, what)


def write(ref: ShmRef, data: bytes | memoryview, what: str) -> None:
    """Copy ``data`` to the start of the referenced bytes of a client region."""
    MAPPINGS.write(ref, data, what)
