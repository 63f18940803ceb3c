"""Which coding an inference response goes in (``Accept-Encoding``), and what it carries."""

from __future__ import annotations

import gzip
import zlib

import pytest

from sluice.gateway.http.compression import MIN_BYTES, accepted, compressed


@pytest.mark.parametrize(
    ("header", "coding"),
    [
        (None, None),
        ("", None),
        ("identity", None),
        ("gzip", "gzip"),
        ("deflate", "deflate"),
        ("gzip, deflate, br", "gzip"),
        ("deflate, gzip;q=0", "deflate"),
        ("GZIP;q=0.5", "gzip"),
        ("*", "gzip"),
        ("*;q=0, deflate", "deflate"),
        ("gzip;q=bad", None),
        ("br, zstd", None),
    ],
)
def test_the_coding_follows_the_clients_weights(header: str | None, coding: str | None) -> None:
    assert accepted(header) == coding


async def test_a_small_body_goes_as_it_is_a_larger_one_compressed() -> None:
    small = b"x" * (MIN_BYTES - 1)
    assert await compressed(small, "gzip") == (small, None)
    large = b'{"outputs": [' + b"1.0, " * 20_000 + b"1.0]}"
    body, coding = await compressed(large, "gzip")
    assert coding == "gzip" and gzip.decompress(body) == large and len(body) < len(large)
    body, coding = await compressed(large, "deflate")
    assert coding == "deflate" and zlib.decompress(body) == large
    assert await compressed(large, None) == (large, None)
