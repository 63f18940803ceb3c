"""Inference responses compressed as the client accepts (``Accept-Encoding``), as Triton's
HTTP server does for tritonclient's ``response_compression_algorithm``: gzip or deflate,
``Content-Encoding`` naming it; ``Inference-Header-Content-Length`` still counts the JSON
header before compression, as the client reads it after decompressing.

A body under :data:`MIN_BYTES` goes as it is (compressing it would cost more than it
saves); a large one is compressed in a worker thread, not on the event loop.
"""

from __future__ import annotations

import asyncio
import zlib

from sluice.gateway.http.body import WBITS

MIN_BYTES = 1024
_OFF_LOOP_BYTES = 64 * 1024
_LEVEL = 6


def accepted(accept_encoding: str | None) -> str | None:
    """The encoding to answer with: gzip, else deflate, among those the client accepts
    with a non-zero weight (None: neither)."""
    if not accept_encoding:
        return None
    weights: dict[str, float] = {}
    for item in accept_encoding.split(","):
        name, _, options = item.partition(";")
        weight = 1.0
        for option in options.split(";"):
            key, _, value = option.strip().partition("=")
            if key.strip().lower() == "q":
                try:
                    weight = float(value)
                except ValueError:
                    weight = 0.0
        weights[name.strip().lower()] = weight
    for name in ("gzip", "deflate"):
        if weights.get(name, weights.get("*", 0.0)) > 0:
            return name
    return None


def _compress(body: bytes, encoding: str) -> bytes:
    compressor = zlib.compressobj(_LEVEL, zlib.DEFLATED, WBITS[encoding])
    return compressor.compress(body) + compressor.flush()


async def compressed(body: bytes, encoding: str | None) -> tuple[bytes, str | None]:
    """``body`` as sent, and the ``Content-Encoding`` to name (None: sent as it is)."""
    if encoding is None or len(body) < MIN_BYTES:
        return body, None
    if len(body) >= _OFF_LOOP_BYTES:
        return await asyncio.to_thread(_compress, body, encoding), encoding
    return _compress(body, encoding), encoding
