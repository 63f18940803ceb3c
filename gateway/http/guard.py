"""Edge checks before any route runs: header limits, API keys, body limits.

Inference routes read their bodies themselves, within ``SLUICE_MAX_BODY_BYTES`` (also
after decompression); every other route may receive at most
``SLUICE_MAX_CONTROL_BODY_BYTES``, checked here against ``Content-Length`` first and then
against the bytes as they arrive, so no route ever buffers more than its limit.

Keys are bearer tokens, checked by the deployment's :class:`~sluice.gateway.tenants.keys.KeyRing`;
each belongs to a tenant, which the guard leaves in the request's scope for the routes that
keep things per tenant.
"""

from __future__ import annotations

from collections.abc import Mapping

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sluice.core.errors import PayloadTooLarge, SluiceError
from sluice.core.request_parameters import ForwardPattern
from sluice.core.restricted_api import Restriction, denial, http_category
from sluice.core.tenants import ANONYMOUS, CURRENT_TENANT
from sluice.gateway.http.body import check_declared_length
from sluice.gateway.inference.header_forwarding import FORWARDED, matching
from sluice.gateway.inference.response import encode_error
from sluice.gateway.tenants.keys import KeyRing, bearer_token

TENANT_STATE = "sluice.tenant"
"""Where the guard leaves the caller's tenant in the ASGI scope's ``state``."""


def is_upload(scope: Scope) -> bool:
    """``POST /v2/uploads``: a file streamed to the batch store, within its own limit."""
    return scope["method"] == "POST" and scope["path"] in ("/v2/uploads", "/v2/uploads/")


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
        forward: ForwardPattern | None = None,
        restricted: Mapping[str, Restriction] | None = None,
    ):
        self.app = app
        self.keys = keys
        self.restricted = restricted or {}
        """Triton's restricted APIs (:mod:`sluice.core.restricted_api`), by category."""
        self.forward = forward
        """Headers that become request parameters
        (:mod:`sluice.gateway.inference.header_forwarding`)."""
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
            given = ((k.decode("latin-1"), v.decode("latin-1")) for k, v in headers)
            refused = denial(self.restricted, http_category(path), given)
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
            or path.startswith(("/predictions/", "/explanations/", "/wfpredict/"))
            or (path.startswith("/v1/models/") and path.endswith((":predict", ":explain")))
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
