"""Edge checks before any route runs: header limits and API keys.

Keys are bearer tokens (``Authorization: Bearer <key>``), compared in constant
time and never logged. Health endpoints are open; management endpoints
(repository, shared memory) need an admin key when admin keys are set;
everything else needs an inference or admin key when inference keys are set.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.infer_response import encode_error
from sluice.errors import InvalidConfig
from sluice.settings import ApiKeySettings

_OPEN = ("/v2/health/",)
_MANAGEMENT = (
    "/v2/repository",
    "/v2/systemsharedmemory",
    "/v2/cudasharedmemory",
    "/v2/logging",
    "/v2/trace",
)


def _read_keys(inline: str, file: str, setting: str) -> frozenset[bytes]:
    keys = [k.strip() for k in inline.split(",") if k.strip()]
    if file:
        try:
            keys += [line.strip() for line in Path(file).read_text().splitlines() if line.strip()]
        except OSError as exc:
            raise InvalidConfig(f"{setting}: cannot read the key file: {exc.strerror}") from None
    return frozenset(k.encode() for k in keys)


@dataclass(frozen=True)
class KeyRing:
    inference: frozenset[bytes]
    admin: frozenset[bytes]

    @classmethod
    def from_settings(cls, settings: ApiKeySettings) -> KeyRing:
        return cls(
            _read_keys(settings.api_keys, settings.api_keys_file, "SLUICE_API_KEYS_FILE"),
            _read_keys(settings.admin_keys, settings.admin_keys_file, "SLUICE_ADMIN_KEYS_FILE"),
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
        management = path.startswith(_MANAGEMENT)
        required = self.admin if management and self.admin else self.inference | self.admin
        if not required:
            return None
        if token is None:
            return 401, "missing API key: send 'Authorization: Bearer <key>'"
        if self._matches(token, required):
            return None
        if management and self._matches(token, self.inference):
            return 403, "this key may not use management endpoints; use an admin key"
        return 401, "invalid API key"


class EdgeGuard:
    """ASGI middleware: 431 past the header limits, 401/403 for missing or wrong keys."""

    def __init__(self, app: ASGIApp, keys: KeyRing, max_header_count: int, max_header_bytes: int):
        self.app = app
        self.keys = keys
        self.max_header_count = max_header_count
        self.max_header_bytes = max_header_bytes

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
        for name, value in headers:
            if name == b"authorization":
                scheme, _, credential = value.partition(b" ")
                token = credential.strip() if scheme.lower() == b"bearer" else b""
                break
        denied = self.keys.check(scope["path"], token)
        if denied is not None:
            extra = [(b"www-authenticate", b"Bearer")] if denied[0] == 401 else []
            await _reject(send, denied[0], denied[1], extra)
            return
        await self.app(scope, receive, send)


async def _reject(
    send: Send, status: int, message: str, extra: list[tuple[bytes, bytes]] | None = None
) -> None:
    body = encode_error(message)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send(
        {"type": "http.response.start", "status": status, "headers": headers + (extra or [])}
    )
    await send({"type": "http.response.body", "body": body})
