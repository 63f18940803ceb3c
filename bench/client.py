"""HTTP plumbing for the bench: loopback targets, blocking JSON GETs, a raw keep-alive client.

The load generator must cost as little CPU as possible (the whole stack shares two
cores), so requests go through :class:`HttpConnection`, an asyncio Protocol that writes
pre-encoded request bytes and parses responses with ``httptools``; no per-request
header building, no HTTP library on the hot path.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any, cast
from urllib.parse import quote, urlsplit

import httptools

LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})


@dataclass(frozen=True)
class Target:
    """A Sluice (or Triton) HTTP endpoint on the loopback interface."""

    host: str
    port: int

    @property
    def authority(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.authority}"


def parse_target(url: str, also_allowed: frozenset[str] = frozenset()) -> Target:
    """Parse ``http://host:port``; refuse anything that is not plain HTTP on loopback (or on
    one of ``also_allowed``: the bench's own test hosts)."""
    parts = urlsplit(url)
    if parts.scheme != "http":
        raise ValueError(f"only http:// URLs are supported, got {url!r}")
    host = parts.hostname or ""
    if host not in LOOPBACK_HOSTS | also_allowed:
        raise ValueError(f"refusing non-loopback host {host!r}: the bench only targets loopback")
    if parts.path not in ("", "/"):
        raise ValueError(f"the URL must not have a path, got {url!r}")
    return Target(host=host, port=parts.port or 80)


def model_path(model: str, suffix: str = "") -> str:
    """``/v2/models/<model><suffix>`` with the model name escaped."""
    return f"/v2/models/{quote(model, safe='')}{suffix}"


# ----------------------------------------------------------------------------- blocking


class HttpError(RuntimeError):
    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body[:500]}")
        self.status = status


# Never route loopback requests through a proxy from the environment.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def get_json(target: Target, path: str, timeout: float = 10.0) -> Any:
    """``GET path`` and decode the JSON body; raise :class:`HttpError` on a non-200 status."""
    try:
        with _OPENER.open(target.url + path, timeout=timeout) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        raise HttpError(exc.code, exc.read().decode(errors="replace")) from None


def wait_until_ready(target: Target, model: str, timeout: float = 60.0) -> None:
    """Poll ``GET /v2/models/<model>/ready`` until it answers 200."""
    deadline = time.monotonic() + timeout
    last_error = "no answer"
    while time.monotonic() < deadline:
        try:
            with _OPENER.open(target.url + model_path(model, "/ready"), timeout=5) as response:
                if response.status == 200:
                    return
        except (OSError, urllib.error.URLError) as exc:
            last_error = str(exc)
        time.sleep(0.2)
    raise TimeoutError(
        f"model {model!r} not ready at {target.url} after {timeout:g}s: {last_error}"
    )


# ----------------------------------------------------------------------------- async


def encode_request(
    target: Target, method: str, path: str, body: bytes, headers: dict[str, str]
) -> bytes:
    """Encode a complete HTTP/1.1 keep-alive request once, for reuse on every send."""
    lines = [f"{method} {path} HTTP/1.1", f"Host: {target.authority}"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


class HttpConnection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection carrying one request at a time."""

    def __init__(self) -> None:
        self._parser = httptools.HttpResponseParser(self)
        self._transport: asyncio.Transport | None = None
        self._waiter: asyncio.Future[tuple[int, bytes]] | None = None
        self._body: list[bytes] = []
        self.closed = False

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(ConnectionError(f"bad HTTP response: {exc}"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._fail(ConnectionError(f"connection lost: {exc or 'closed by server'}"))

    # httptools callbacks
    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        status = self._parser.get_status_code()
        body = b"".join(self._body)
        self._body = []
        if not self._parser.should_keep_alive():
            self.close()
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result((status, body))

    # client API
    async def request(self, raw: bytes) -> tuple[int, bytes]:
        """Send pre-encoded request bytes; return ``(status, body)`` of the response."""
        if self.closed or self._transport is None:
            raise ConnectionError("connection is closed")
        self._waiter = asyncio.get_running_loop().create_future()
        self._transport.write(raw)
        return await self._waiter

    def close(self) -> None:
        self.closed = True
        if self._transport is not None:
            self._transport.close()

    def _fail(self, exc: Exception) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)


async def connect(target: Target) -> HttpConnection:
    loop = asyncio.get_running_loop()
    _, protocol = await loop.create_connection(HttpConnection, target.host, target.port)
    return protocol
