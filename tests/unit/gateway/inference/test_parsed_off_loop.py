"""Which REST requests the data plane parses on a thread: large bodies, and any body naming
a BYTES input in a shared memory region (its elements are read and counted there, however
small the body), whichever way its JSON spells the names."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import orjson
import pytest

from sluice.gateway.inference import data_plane


def _region_input(datatype: str = "BYTES") -> dict[str, Any]:
    return {
        "name": "s",
        "shape": [1],
        "datatype": datatype,
        "parameters": {"shared_memory_region": "r", "shared_memory_byte_size": 8},
    }


def _escaped(body: bytes, *words: bytes) -> bytes:
    """``body`` with the last letter of each word written as a JSON \\u escape."""
    for word in words:
        body = body.replace(word, word[:-1] + b"\\u%04x" % word[-1])
    return body


async def _heavy(monkeypatch: pytest.MonkeyPatch, body: bytes, json_length: int | None) -> bool:
    """Whether :func:`data_plane.prepare` asks for ``body`` to be parsed on a thread."""
    seen: list[bool] = []

    async def prepare_with(*args: Any, **kwargs: Any) -> None:
        seen.append(args[4])

    monkeypatch.setattr(data_plane, "prepare_with", prepare_with)
    await data_plane.prepare(SimpleNamespace(), "m", None, body, json_length)
    return seen[0]


@pytest.mark.parametrize(
    "words",
    [(b"BYTES",), (b"shared_memory_region",), (b"BYTES", b"shared_memory_region")],
    ids=["datatype", "parameter", "both"],
)
async def test_a_bytes_region_input_is_parsed_on_a_thread_however_spelled(
    monkeypatch: pytest.MonkeyPatch, words: tuple[bytes, ...]
) -> None:
    body = orjson.dumps({"inputs": [_region_input()]})
    assert await _heavy(monkeypatch, body, None)
    escaped = _escaped(body, *words)
    assert orjson.loads(escaped) == orjson.loads(body)  # (the same request)
    assert await _heavy(monkeypatch, escaped, None)
    assert await _heavy(monkeypatch, escaped + b"\x00" * 8, len(escaped))


async def test_other_small_bodies_stay_on_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """Escapes alone (tritonclient writes non-ASCII strings so) cost no thread hop."""
    text = {"name": "t", "shape": [1], "datatype": "BYTES", "data": ["h\u00e9llo"]}
    body = _escaped(orjson.dumps({"inputs": [text, _region_input("FP32")]}), b"BYTES")
    assert b"\\u" in body
    assert not await _heavy(monkeypatch, body, None)
    assert not await _heavy(monkeypatch, b"\\u0041", 0)  # (raw binary: no JSON)
    assert not await _heavy(monkeypatch, b"{not json \\u", None)
    assert await _heavy(monkeypatch, b" " * (data_plane.OFFLOAD_BYTES + 1), None)
