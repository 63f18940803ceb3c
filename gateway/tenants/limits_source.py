"""Where a gateway process gets its tenant limits, and how it follows their changes.

At start, from ``SLUICE_TENANT_LIMITS_FILE`` (or, without a file, the inline
``SLUICE_TENANT_LIMITS``): anything wrong stops the gateway with the message. Then, from the
periodic refresh (:mod:`sluice.gateway.control.catalog_refresh`), the file's ``(mtime_ns, size)`` is
looked at no more than once a second; when it changed the file is read again. A file that
cannot be read or used is logged with the entry at fault and counted
(``sluice_tenant_limits_reload_errors_total``), and the limits in force stay.

The weights of the limits in force go to Redis (:attr:`Keys.tenant_weights`), for the
workers, at start and whenever they change. Every gateway process writes the same hash: their
files should agree (a deployment on several hosts ships the same file to each).
"""

from __future__ import annotations

import logging
import os
import stat
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from sluice.core.errors import InvalidConfig
from sluice.core.settings import GatewaySettings
from sluice.core.tenant_limits import TenantLimits, TenantLimitsError, parse_tenant_limits
from sluice.core.tenants import ANONYMOUS
from sluice.gateway.tenants.keys import KeyRing

log = logging.getLogger(__name__)

CHECK_EVERY_S = 1.0
"""The file is looked at no more often than this."""

FileSignature = tuple[int, int]
"""A file's (mtime_ns, size): when it moves, the file is read again."""


def tenants_of(keys: KeyRing) -> frozenset[str]:
    """The tenants that exist: those of the keys, or ``anonymous`` alone without keys."""
    if not keys.configured:
        return frozenset({ANONYMOUS})
    return frozenset(entry.tenant for entry in (*keys.inference, *keys.admin))


@dataclass
class LimitsSource:
    """The limits file followed by this process (none: the limits never change)."""

    path: str = ""
    tenants: Collection[str] = frozenset({ANONYMOUS})
    signature: FileSignature | None = None
    """The signature of the file as last read (or found unusable)."""
    checked_at: float = float("-inf")
    clock: Callable[[], float] = time.monotonic
    reload_errors: int = 0
    """Reloads that failed since the last hand-over to the metrics."""
    last_error: str = ""
    weights_written: bool = False
    """Whether Redis has the weights of the limits in force."""
    loaded: TenantLimits = field(default_factory=TenantLimits)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)
    """Guards :attr:`reload_errors`: the file is read in a worker thread
    (:func:`sluice.gateway.tenants.sync.follow_tenant_limits`), the count taken on the loop."""

    def due(self) -> bool:
        """Whether :meth:`changed_limits` would look at the file now."""
        return bool(self.path) and self.clock() - self.checked_at >= CHECK_EVERY_S

    def changed_limits(self) -> TenantLimits | None:
        """New limits when the file changed and reads well; None otherwise (at most one
        look a second; a bad file is logged and counted once per change). It reads and
        parses the file: not on the event loop."""
        now = self.clock()
        if not self.path or now - self.checked_at < CHECK_EVERY_S:
            return None
        self.checked_at = now
        try:
            found = os.stat(self.path)
            signature: FileSignature | None = (found.st_mtime_ns, found.st_size)
        except OSError as exc:
            self._failed(f"{_source(self.path)}: cannot be read: {exc.strerror}", None)
            return None
        if signature == self.signature:
            return None
        try:
            limits = read_limits(self.path, self.tenants)
        except TenantLimitsError as exc:
            self._failed(str(exc), signature)
            return None
        self.signature, self.last_error, self.loaded = signature, "", limits
        log.info("tenant limits reloaded from %s", self.path)
        return limits

    def _failed(self, message: str, signature: FileSignature | None) -> None:
        self.signature = signature
        if message == self.last_error:
            return
        self.last_error = message
        with self._lock:
            self.reload_errors += 1
        log.error("%s; the previous tenant limits stay in force", message)

    def take_reload_errors(self) -> int:
        with self._lock:
            taken, self.reload_errors = self.reload_errors, 0
        return taken

    def give_back_reload_errors(self, count: int) -> None:
        """Count again what :meth:`take_reload_errors` took (it could not be written)."""
        with self._lock:
            self.reload_errors += count


def _source(path: str) -> str:
    return f"tenant limits file {path}"


MAX_FILE_BYTES = 1 << 20
"""A limits file is at most this large (parsing one takes about a second): thousands of
tenants' tables fit."""


def read_limits(path: str, tenants: Collection[str]) -> TenantLimits:
    """The limits of the file at ``path``; TenantLimitsError naming what is wrong.

    Only a regular file (a symbolic link to one, as Kubernetes mounts a ConfigMap, counts)
    of at most :data:`MAX_FILE_BYTES` is read: a FIFO put in its place would block the
    process until something writes to it, a device such as ``/dev/zero`` would never end."""
    try:
        # (O_NONBLOCK: opening a FIFO does not wait for a writer; a regular file ignores it)
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise TenantLimitsError(f"{_source(path)}: cannot be read: {exc.strerror}") from None
    with os.fdopen(descriptor, "rb") as file:
        try:
            status = os.fstat(descriptor)
            if not stat.S_ISREG(status.st_mode):
                raise TenantLimitsError(
                    f"{_source(path)}: not a regular file ({_kind(status.st_mode)})"
                )
            if status.st_size > MAX_FILE_BYTES:
                raise TenantLimitsError(
                    f"{_source(path)}: {status.st_size} bytes, more than the "
                    f"{MAX_FILE_BYTES} a limits file may have"
                )
            data = file.read(MAX_FILE_BYTES + 1)
        except OSError as exc:
            raise TenantLimitsError(f"{_source(path)}: cannot be read: {exc.strerror}") from None
    if len(data) > MAX_FILE_BYTES:  # (it grew while being read)
        raise TenantLimitsError(
            f"{_source(path)}: more than the {MAX_FILE_BYTES} bytes a limits file may have"
        )
    try:
        text = data.decode()
    except UnicodeDecodeError as exc:
        raise TenantLimitsError(f"{_source(path)}: not UTF-8 text ({exc.reason})") from None
    return parse_tenant_limits(text, _source(path), tenants)


def _kind(mode: int) -> str:
    """What a file that is not a regular one is, for the error."""
    for test, kind in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return kind
    return f"mode {stat.S_IFMT(mode):o}"


def load_at_start(settings: GatewaySettings) -> LimitsSource:
    """The limits of the settings (the file when set, else the inline TOML) and the source
    to follow; InvalidConfig naming what is wrong, so the gateway does not start."""
    tenants = tenants_of(KeyRing.from_settings(settings))
    path = settings.tenant_limits_file
    source = LimitsSource(path=path, tenants=tenants)
    try:
        if path:
            stat = os.stat(path)
            source.loaded = read_limits(path, tenants)
            source.signature = (stat.st_mtime_ns, stat.st_size)
            source.checked_at = source.clock()
        elif settings.tenant_limits.strip():
            source.loaded = parse_tenant_limits(
                settings.tenant_limits, "SLUICE_TENANT_LIMITS", tenants
            )
    except OSError as exc:
        raise InvalidConfig(
            f"SLUICE_TENANT_LIMITS_FILE: {_source(path)}: cannot be read: {exc.strerror}"
        ) from None
    except TenantLimitsError as exc:
        raise InvalidConfig(str(exc)) from None
    if path and settings.tenant_limits.strip():
        log.warning("SLUICE_TENANT_LIMITS is ignored: SLUICE_TENANT_LIMITS_FILE is set")
    return source
