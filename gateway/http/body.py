"""Reading request bodies within the configured size limit, compressed or not."""

from __future__ import annotations

import asyncio
import zlib

from starlette.requests import Request

from sluice.core.errors import InvalidInput, PayloadTooLarge
from sluice.gateway.body_budget import BodyReservation

WBITS = {"gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}
"""zlib's window bits of each HTTP content coding Sluice reads and writes."""
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


async def read_body(
    request: Request, limit: int, reservation: BodyReservation | None = None
) -> bytes:
    """The (decompressed) body; 413 past ``limit`` bytes, 400 for a bad encoding.
    ``reservation``: the process's body budget, which holds the bytes as they come (the
    declared length at once); 503 when it cannot. The caller releases it."""
    declared = check_declared_length(request.headers.get("content-length"), limit)
    if reservation is not None and declared:
        reservation.ensure(declared)
    chunks = bytearray()
    async for chunk in request.stream():
        chunks += chunk
        if len(chunks) > limit:
            raise too_large(limit)
        if reservation is not None:
            reservation.ensure(len(chunks))
    body = await decoded_body(bytes(chunks), request.headers.get("content-encoding"), limit)
    if reservation is not None:
        reservation.ensure(len(body))
    return body


INLINE_DECODED_BYTES = 256 * 1024
"""A compressed body is inflated on the event loop up to this many bytes (well under a
millisecond); the rest of a larger one is inflated in a worker thread."""


async def decoded_body(body: bytes, content_encoding: str | None, limit: int) -> bytes:
    """:func:`decode_body` without blocking the event loop on a large body (however
    small its compressed form): the first :data:`INLINE_DECODED_BYTES` are inflated here,
    the rest in a worker thread."""
    encoding = _encoding(content_encoding)
    if encoding is None:
        return body
    inflater = _Inflater(encoding, limit)
    head = inflater.inflate(body, min(INLINE_DECODED_BYTES, limit + 1))
    if len(head) < min(INLINE_DECODED_BYTES, limit + 1):  # all there is: nothing held back
        return inflater.checked(head)
    return await asyncio.to_thread(inflater.finish, head)


def decode_body(body: bytes, content_encoding: str | None, limit: int) -> bytes:
    """The body decompressed as ``Content-Encoding`` says (gzip, deflate or identity);
    413 past ``limit`` decompressed bytes, 400 for an unknown encoding or bad data."""
    encoding = _encoding(content_encoding)
    if encoding is None:
        return body
    inflater = _Inflater(encoding, limit)
    return inflater.checked(inflater.inflate(body, limit + 1))


def _encoding(content_encoding: str | None) -> str | None:
    """The compression named (None for identity); 400 for one Sluice does not read."""
    encoding = (content_encoding or "identity").strip().lower()
    if encoding in ("", "identity"):
        return None
    if encoding not in WBITS:
        raise InvalidInput(f"header 'Content-Encoding': unsupported encoding '{encoding}'")
    return encoding


class _Inflater:
    """One body's decompression, in steps that each produce at most a given number of
    bytes, so that it can start on the event loop and end in a thread."""

    def __init__(self, encoding: str, limit: int) -> None:
        self.encoding = encoding
        self.limit = limit
        self.decompressor = zlib.decompressobj(WBITS[encoding])

    def inflate(self, data: bytes, max_length: int) -> bytes:
        try:
            return self.decompressor.decompress(data, max_length)
        except zlib.error as exc:
            raise InvalidInput(f"request body is not valid {self.encoding}: {exc}") from None

    def finish(self, head: bytes) -> bytes:
        """``head`` (what came out so far) and the rest, checked."""
        room = self.limit + 1 - len(head)
        if room <= 0:  # (and max_length 0 would mean no limit at all)
            return self.checked(head)
        return self.checked(head + self.inflate(self.decompressor.unconsumed_tail, room))

    def checked(self, out: bytes) -> bytes:
        """``out``, all the body gave: 413 past the limit, 400 when the data stopped short."""
        if len(out) > self.limit or self.decompressor.unconsumed_tail:
            raise PayloadTooLarge(
                f"decompressed request body exceeds the limit of {self.limit} bytes"
            )
        if not self.decompressor.eof:
            raise InvalidInput(f"request body is truncated {self.encoding} data")
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
