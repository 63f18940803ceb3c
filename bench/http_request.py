"""Take a pre-encoded HTTP/1.1 request apart for the C load generators.

:class:`bench.payload.InferRequest` holds the whole message (``raw``); wrk and h2load
build their own request line and ``Host``/``Content-Length`` headers, and need the method,
the path, the other headers and the body separately.
"""

from __future__ import annotations

from dataclasses import dataclass

# Headers the load generators write themselves.
_OWN_HEADERS = frozenset({"host", "content-length"})


@dataclass(frozen=True)
class RequestParts:
    method: str
    path: str
    headers: dict[str, str]  # without Host and Content-Length
    body: bytes


def split_request(raw: bytes) -> RequestParts:
    """Method, path, headers and body of an encoded HTTP/1.1 request."""
    head, separator, body = raw.partition(b"\r\n\r\n")
    if not separator:
        raise ValueError("not an HTTP/1.1 request: no blank line after the headers")
    request_line, *header_lines = head.decode("latin-1").split("\r\n")
    method, path, _version = request_line.split(" ", 2)
    headers: dict[str, str] = {}
    for line in header_lines:
        name, _, value = line.partition(":")
        if name.strip().lower() not in _OWN_HEADERS:
            headers[name.strip()] = value.strip()
    return RequestParts(method, path, headers, body)
