"""Reading request bodies within the configured size limit, compressed or not."""

from __future__ import annotations

import zlib

from starlette.requests import Request

from sluice.core.errors import InvalidInput, PayloadTooLarge

_WBITS = {"gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}
_MAX_DIGITS = 18
"""More digits than any size we could accept (and int() refuses beyond 4,300)."""


def _natural(raw: str, header: str) -> int | None:
    """The header's non-negative integer; None when it has too many digits to matter."""
    raw = raw.strip()
    if not (raw.isascii() and raw.isdigit()):
        raise InvalidInput(f"header '{header}' is not a non-negative integer")
    stripped = raw.lstrip("0") or "0"
    return None if len(stripped) > _MAX_DIGITS else int(stripped)


def check_declared_length(declared: str | None, limit: int) -> int | None:
    """The declared ``Content-Length`` (None when absent); 413 beyond ``limit``."""
    if declared is None:
        return None
    length = _natural(declared, "Content-Length")
    if length is None or length > limit:
        shown = declared.strip() if length is not None else f"{len(declared.strip())}-digit"
        raise PayloadTooLarge(f"request body of {shown} bytes exceeds the limit of {limit}")
    return length


def too_large(limit: int) -> PayloadTooLarge:
    return PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")


async def read_body(request: Request, limit: int) -> bytes:
    """The (decompressed) body; 413 past ``limit`` bytes, 400 for a bad encoding."""
    check_declared_length(request.headers.get("content-length"), limit)
    chunks = bytearray()
    async for chunk in request.stream():
        chunks += chunk
        if len(chunks) > limit:
            raise too_large(limit)
    return decode_body(bytes(chunks), request.headers.get("content-encoding"), limit)


def decode_body(body: bytes, content_encoding: str | None, limit: int) -> bytes:
    encoding = (content_encoding or "identity").strip().lower()
    if encoding in ("", "identity"):
        return body
    if encoding not in _WBITS:
        raise InvalidInput(f"header 'Content-Encoding': unsupported encoding '{encoding}'")
    return _decompress(body, _WBITS[encoding], limit, encoding)


def _decompress(body: bytes, wbits: int, limit: int, encoding: str) -> bytes:
    decompressor = zlib.decompressobj(wbits)
    try:
        out = decompressor.decompress(body, limit + 1)
    except zlib.error as exc:
        raise InvalidInput(f"request body is not valid {encoding}: {exc}") from None
    if len(out) > limit or decompressor.unconsumed_tail:
        raise PayloadTooLarge(f"decompressed request body exceeds the limit of {limit} bytes")
    if not decompressor.eof:
        raise InvalidInput(f"request body is truncated {encoding} data")
    return out


def parse_header_length(raw: str | None) -> int | None:
    if raw is None:
        return None
    length = _natural(raw, "Inference-Header-Content-Length")
    if length is None:
        raise InvalidInput(
            f"header 'Inference-Header-Content-Length' ({len(raw.strip())} digits) is larger "
            "than any request body"
        )
    return length
