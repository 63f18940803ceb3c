"""Edge checks before any route runs: header limits, API keys, body limits.

Inference routes read their bodies themselves, within ``SLUICE_MAX_BODY_BYTES`` (also
after decompression); every other route may receive at most
``SLUICE_MAX_CONTROL_BODY_BYTES``, checked here against ``Content-Length`` first and then
against the bytes as they arrive, so no route ever buffers more than its limit.

Keys are bearer tokens (``Authorization: Bearer <key>``), compared in constant
time and never logged. Health endpoints are open; management endpoints
(repository, shared memory) need an admin key when admin keys are set;
everything else needs an inference or admin key when inference keys are set.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.body import check_declared_length
from gateway.infer_response import encode_error
from sluice.errors import InvalidConfig, PayloadTooLarge, SluiceError
from sluice.settings import ApiKeySettings

_OPEN = ("/v2/health/", "/ping")
_MANAGEMENT = (
    "/v2/repository",
    "/v2/systemsharedmemory",
    "/v2/cudasharedmemory",
    "/v2/logging",
    "/v2/trace",
    "/models",
)


def _read_keys(read: Callable[[], list[str]], setting: str) -> frozenset[bytes]:
    try:
        return frozenset(key.encode() for key in read())
    except OSError as exc:
        raise InvalidConfig(f"{setting}: cannot read the key file: {exc.strerror}") from None


def bearer_token(value: bytes) -> bytes:
    """The key of an ``Authorization: Bearer <key>`` value (empty for another scheme)."""
    scheme, _, credential = value.partition(b" ")
    return credential.strip() if scheme.lower() == b"bearer" else b""


@dataclass(frozen=True)
class KeyRing:
    inference: frozenset[bytes]
    admin: frozenset[bytes]

    @classmethod
    def from_settings(cls, settings: ApiKeySettings) -> KeyRing:
        return cls(
            _read_keys(settings.inference_keys, "SLUICE_API_KEYS_FILE"),
            _read_keys(settings.admin_key_list, "SLUICE_ADMIN_KEYS_FILE"),
        )

    @staticmethod
    def _matches(token: bytes, keys: Iterable[bytes]) -> bool:
        found = False
        for key in keys:  # no early exit: the time taken does not depend on which key matched
            found |= hmac.compare_digest(token, key)
        return found

    def check(self, path: str, token: bytes | None) -> tuple[int, str] | None:
        """None when allowed, else (status, message)."""
        if path.startswith(_OPEN):
            return None
        return self.check_call(path.startswith(_MANAGEMENT), token)

    def check_call(self, management: bool, token: bytes | None) -> tuple[int, str] | None:
        """As :meth:`check`, for a call known to be a management one or not (gRPC)."""
        if management and self.admin:
            required = self.admin
        elif self.inference:
            required = self.inference | self.admin
        else:  # admin keys alone guard the management endpoints only
            return None
        if token is None:
            return 401, "missing API key: send 'Authorization: Bearer <key>'"
        if self._matches(token, required):
            return None
        if management and self._matches(token, self.inference):
            return 403, "this key may not use management endpoints; use an admin key"
        return 401, "invalid API key"


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
    ):
        self.app = app
        self.keys = keys
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
        denied = self.keys.check(path, token)
        if denied is not None:
            extra = [(b"www-authenticate", b"Bearer")] if denied[0] == 401 else []
            await _reject(send, denied[0], denied[1], extra)
            return
        if (
            path.startswith("/v2/models/")
            and path.endswith(("/infer", "/generate", "/generate_stream"))
        ) or path.startswith("/predictions/"):
            # The inference routes enforce SLUICE_MAX_BODY_BYTES themselves.
            await self.app(scope, receive, send)
            return
        limit = self.max_control_body_bytes
        try:
            check_declared_length(None if length is None else length.decode("latin-1"), limit)
        except SluiceError as exc:
            await _reject(send, int(exc.status), exc.message)
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
