"""Edge checks before any route runs: header limits, API keys, body limits.

Inference routes read their bodies themselves, within ``SLUICE_MAX_BODY_BYTES`` (also
after decompression); every other route may receive at most
``SLUICE_MAX_CONTROL_BODY_BYTES``, checked here against ``Content-Length`` first and then
against the bytes as they arrive, so no route ever buffers more than its limit.

Keys are bearer tokens (``Authorization: Bearer <key>``), compared in constant
time and never logged; each belongs to a tenant (:mod:`sluice.core.tenants`), which the guard
leaves in the request's scope for the routes that keep things per tenant. Health endpoints
are open; whenever any key is set, management endpoints (repository, model control,
shared memory, logging, trace, TorchServe's management API) need an admin key and
everything else needs a key.
"""

from __future__ import annotations

import hmac
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sluice.core.errors import InvalidConfig, PayloadTooLarge, SluiceError
from sluice.core.restricted_api import Restriction, denial, http_category
from sluice.core.settings import ApiKeySettings
from sluice.core.tenants import ADMIN, ANONYMOUS, CURRENT_TENANT, KeyEntry, parse_key_entry
from sluice.gateway.body import check_declared_length
from sluice.gateway.header_forwarding import FORWARDED, matching
from sluice.gateway.infer_response import encode_error

_OPEN = ("/v2/health/", "/ping")
_MANAGEMENT = (
    "/v2/repository",
    "/v2/systemsharedmemory",
    "/v2/cudasharedmemory",
    "/v2/logging",
    "/v2/trace",
    "/models",
)
_MODEL_TRACE = re.compile(r"/v2/models/[^/]+(?:/versions/[^/]+)?/trace/setting/?")

TENANT_STATE = "sluice.tenant"
"""Where the guard leaves the caller's tenant in the ASGI scope's ``state``."""


def is_upload(scope: Scope) -> bool:
    """``POST /v2/uploads``: a file streamed to the batch store, within its own limit."""
    return scope["method"] == "POST" and scope["path"] in ("/v2/uploads", "/v2/uploads/")


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


def tenant_of(scope: Scope) -> str:
    """The tenant the guard found for this request (``anonymous`` without keys)."""
    state = scope.get("state")
    tenant = state.get(TENANT_STATE) if isinstance(state, dict) else None
    return tenant if isinstance(tenant, str) else ANONYMOUS


class EdgeGuard:
    """ASGI middleware: 431 past the header limits, 401/403 for missing or wrong keys,
    413 past the body limit of routes other than inference."""

    def __init__(
        self,
        app: ASGIApp,
        keys: KeyRing,
        max_header_count: int,
        max_header_bytes: int,
        max_control_body_bytes: int,
        forward: re.Pattern[str] | None = None,
        restricted: Mapping[str, Restriction] | None = None,
    ):
        self.app = app
        self.keys = keys
        self.restricted = restricted or {}
        """Triton's restricted APIs (:mod:`sluice.core.restricted_api`), by category."""
        self.forward = forward
        """Headers that become request parameters (:mod:`sluice.gateway.header_forwarding`)."""
        self.max_header_count = max_header_count
        self.max_header_bytes = max_header_bytes
        self.max_control_body_bytes = max_control_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = scope["headers"]
        if len(headers) > self.max_header_count:
            await _reject(
                send, 431, f"too many request headers ({len(headers)} > {self.max_header_count})"
            )
            return
        size = sum(len(k) + len(v) for k, v in headers)
        if size > self.max_header_bytes:
            await _reject(
                send, 431, f"request headers too large ({size} > {self.max_header_bytes} bytes)"
            )
            return
        token = None
        length: bytes | None = None
        for name, value in headers:
            if name == b"authorization" and token is None:
                token = bearer_token(value)
            elif name == b"content-length":
                length = value
        path = scope["path"]
        if self.restricted:
            lowered = {k.decode("latin-1"): v.decode("latin-1") for k, v in headers}
            refused = denial(self.restricted, http_category(path), lowered)
            if refused is not None:
                await _reject(send, 403, refused)
                return
        access = self.keys.access(path, token)
        if access.status:
            extra = [(b"www-authenticate", b"Bearer")] if access.status == 401 else []
            await _reject(send, access.status, access.message, extra)
            return
        scope.setdefault("state", {})[TENANT_STATE] = access.tenant
        CURRENT_TENANT.set(access.tenant)
        if self.forward is not None:
            pairs = ((k.decode("latin-1"), v.decode("latin-1")) for k, v in headers)
            FORWARDED.set(matching(self.forward, pairs))
        if (
            (
                path.startswith("/v2/models/")
                and path.endswith(("/infer", "/generate", "/generate_stream"))
            )
            or path.startswith("/predictions/")
            or is_upload(scope)
        ):
            # The inference routes enforce SLUICE_MAX_BODY_BYTES themselves, uploads
            # SLUICE_MAX_UPLOAD_BYTES (streamed to the batch store, never held).
            await self.app(scope, receive, send)
            return
        limit = self.max_control_body_bytes
        try:
            check_declared_length(None if length is None else length.decode("latin-1"), limit)
        except SluiceError as exc:
            await _reject(send, int(exc.status), exc.message, [(b"connection", b"close")])
            return
        await self.app(scope, _limited(receive, limit), send)


def _limited(receive: Receive, limit: int) -> Receive:
    """``receive`` that raises 413 (handled by the application) past ``limit`` body bytes."""
    received = 0

    async def limited() -> Message:
        nonlocal received
        message = await receive()
        received += len(message.get("body", b""))
        if received > limit:
            raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
        return message

    return limited


async def _reject(
    send: Send, status: int, message: str, extra: list[tuple[bytes, bytes]] | None = None
) -> None:
    body = encode_error(message)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send(
        {"type": "http.response.start", "status": status, "headers": headers + (extra or [])}
    )
    await send({"type": "http.response.body", "body": body})
