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
    await data_plane.prepare(SimpleNamespace(), "m", None, body, json_length)  # type: ignore[arg-type]
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


def _json_body(datatype: str, data: list[Any]) -> bytes:
    return orjson.dumps(
        {"inputs": [{"name": "x", "shape": [len(data)], "datatype": datatype, "data": data}]}
    )


def _binary_body(datatype: str, data: bytes) -> tuple[bytes, int]:
    """A body of the binary tensor extension and its header's length."""
    entry = {
        "name": "x",
        "shape": [1],
        "datatype": datatype,
        "parameters": {"binary_data_size": len(data)},
    }
    header = orjson.dumps({"inputs": [entry]})
    return header + data, len(header)


async def test_json_of_many_elements_is_parsed_on_a_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """JSON costs per element, not per byte: past PARSED_ON_LOOP_BYTES of it, whatever the
    body's size, a thread parses it (a list of numbers or of strings alike)."""
    limit = data_plane.PARSED_ON_LOOP_BYTES
    assert limit < data_plane.OFFLOAD_BYTES
    for datatype, element in (("FP32", 0), ("BYTES", "")):
        small = _json_body(datatype, [element] * 64)
        assert len(small) <= limit
        assert not await _heavy(monkeypatch, small, None)
        many = _json_body(datatype, [element] * (limit // 2))
        assert limit < len(many) < data_plane.OFFLOAD_BYTES
        assert await _heavy(monkeypatch, many, None)
        header, binary = many + b"\x00" * 16, len(many)
        assert await _heavy(monkeypatch, header, binary)  # (a JSON header as large)


async def test_binary_tensors_stay_on_the_loop_unless_their_elements_are_counted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Binary data is sliced, not read: up to OFFLOAD_BYTES it stays on the loop, raw or
    behind a JSON header, unless the header names a BYTES input, whose elements are
    counted one by one (past PARSED_ON_LOOP_BYTES of them: on a thread)."""
    limit, offload = data_plane.PARSED_ON_LOOP_BYTES, data_plane.OFFLOAD_BYTES
    tensor = b"\x00" * (offload - 1024)
    assert not await _heavy(monkeypatch, tensor, 0)  # (raw binary: no JSON)
    assert not await _heavy(monkeypatch, *_binary_body("FP32", tensor))
    assert await _heavy(monkeypatch, *_binary_body("BYTES", tensor))
    assert not await _heavy(monkeypatch, *_binary_body("BYTES", b"\x00" * limit))
    escaped_body, length = _binary_body("BYTES", tensor)
    escaped = _escaped(escaped_body[:length], b"BYTES")
    assert await _heavy(monkeypatch, escaped + tensor, len(escaped))
    fp32 = _escaped(_binary_body("FP32", b"")[0], b"FP32")
    assert not await _heavy(monkeypatch, fp32 + tensor, len(fp32))


async def test_a_header_length_outside_the_body_costs_no_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The parser refuses it at once."""
    body = _json_body("BYTES", [""] * data_plane.PARSED_ON_LOOP_BYTES)
    assert not await _heavy(monkeypatch, body, len(body) + 1)
    assert not await _heavy(monkeypatch, body, -1)
