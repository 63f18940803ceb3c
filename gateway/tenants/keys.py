"""API keys: each a bearer token of a tenant (:mod:`sluice.core.tenants`), compared in
constant time and never logged. Health endpoints are open; whenever any key is set,
management endpoints (repository, model control, shared memory, logging, trace,
TorchServe's management API) need an admin key and everything else needs a key. The HTTP
edge (:mod:`sluice.gateway.http.guard`) and the gRPC server ask the same :class:`KeyRing`.
"""

from __future__ import annotations

import hmac
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from sluice.core.errors import InvalidConfig
from sluice.core.settings import ApiKeySettings
from sluice.core.tenants import ADMIN, ANONYMOUS, KeyEntry, parse_key_entry

_OPEN = ("/v2/health/", "/ping")
_MANAGEMENT = (
    "/v2/repository",
    "/v2/systemsharedmemory",
    "/v2/cudasharedmemory",
    "/v2/logging",
    "/v2/trace",
    "/models",
    "/workflows",
)
_MODEL_TRACE = re.compile(r"/v2/models/[^/]+(?:/versions/[^/]+)?/trace/setting/?")


def is_management(path: str) -> bool:
    """Whether a route changes or reveals the deployment itself (an admin key's)."""
    return path.startswith(_MANAGEMENT) or bool(_MODEL_TRACE.fullmatch(path))


def _read_keys(
    read: Callable[[], list[str]], setting: str, default_tenant: str | None
) -> tuple[KeyEntry, ...]:
    try:
        entries = read()
    except OSError as exc:
        raise InvalidConfig(f"{setting}_FILE: cannot read the key file: {exc.strerror}") from None
    try:
        return tuple(parse_key_entry(entry, default_tenant) for entry in entries)
    except ValueError as exc:
        raise InvalidConfig(f"{setting} (or {setting}_FILE): {exc}") from None


def bearer_token(value: bytes) -> bytes:
    """The key of an ``Authorization: Bearer <key>`` value (empty for another scheme)."""
    scheme, _, credential = value.partition(b" ")
    return credential.strip() if scheme.lower() == b"bearer" else b""


@dataclass(frozen=True, slots=True)
class Access:
    """What the guard decided: the caller's tenant, or why it is refused."""

    tenant: str = ANONYMOUS
    status: int = 0
    """0: allowed; else 401 or 403."""
    message: str = ""

    @property
    def denied(self) -> tuple[int, str] | None:
        return (self.status, self.message) if self.status else None


_MISSING = Access(status=401, message="missing API key: send 'Authorization: Bearer <key>'")
_INVALID = Access(status=401, message="invalid API key")
_NOT_ADMIN = Access(
    status=403, message="this key may not use management endpoints; use an admin key"
)
_NO_ADMIN_KEYS = Access(
    status=403,
    message="management endpoints need an admin key, and none is set (SLUICE_ADMIN_KEYS)",
)


@dataclass(frozen=True)
class KeyRing:
    """The deployment's keys, each with its tenant. Whenever any key is set, every route
    but health needs one, and management routes need an admin key (refused to everybody
    when only inference keys are set). Without keys everything is open to one tenant,
    ``anonymous``."""

    inference: tuple[KeyEntry, ...] = ()
    admin: tuple[KeyEntry, ...] = ()

    @classmethod
    def from_settings(cls, settings: ApiKeySettings) -> KeyRing:
        return cls(
            _read_keys(settings.inference_keys, "SLUICE_API_KEYS", None),
            _read_keys(settings.admin_key_list, "SLUICE_ADMIN_KEYS", ADMIN),
        )

    @property
    def configured(self) -> bool:
        return bool(self.inference or self.admin)

    @staticmethod
    def _match(token: bytes, entries: Iterable[KeyEntry]) -> str | None:
        found: str | None = None
        for entry in entries:  # no early exit: the time taken does not depend on the match
            if hmac.compare_digest(token, entry.key):
                found = entry.tenant
        return found

    def check(self, path: str, token: bytes | None) -> tuple[int, str] | None:
        """None when allowed, else (status, message)."""
        return self.access(path, token).denied

    def access(self, path: str, token: bytes | None) -> Access:
        """Who calls ``path`` with ``token``, or why not."""
        if path.startswith(_OPEN):
            return Access()
        return self.access_call(is_management(path), token)

    def access_call(self, management: bool, token: bytes | None) -> Access:
        """As :meth:`access`, for a call known to be a management one or not (gRPC)."""
        if not self.configured:
            return Access()
        if token is None:
            return _MISSING
        admin = self._match(token, self.admin)
        if admin is not None:
            return Access(admin)
        user = self._match(token, self.inference)
        if user is None:
            return _INVALID
        if management:
            return _NOT_ADMIN if self.admin else _NO_ADMIN_KEYS
        return Access(user)

    def check_call(self, management: bool, token: bytes | None) -> tuple[int, str] | None:
        return self.access_call(management, token).denied
