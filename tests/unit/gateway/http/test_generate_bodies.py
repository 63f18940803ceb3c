"""The generate extension's routes hold their clients' bodies within the gateway process's
budget (``SLUICE_MAX_BUFFERED_BODY_BYTES``), as ``/infer`` does: a flood of large bodies is
refused (503) instead of exhausting the host's memory, and a body's bytes go back to the
budget once it is answered (a stream's, once its first response came)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
from starlette.requests import Request
from starlette.types import Message

from sluice.core.errors import ServerBusy
from sluice.gateway.body_budget import BodyBudget
from sluice.gateway.http import generate_routes


def request(state: Any, body: bytes) -> Request:
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> Message:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v2/models/m/generate",
        "headers": [(b"content-length", str(len(body)).encode())],
        "query_string": b"",
        "app": SimpleNamespace(state=SimpleNamespace(sluice=state)),
    }
    return Request(scope, receive)


@pytest.fixture
def gateway(monkeypatch: pytest.MonkeyPatch) -> tuple[Any, asyncio.Event]:
    """A gateway process whose body budget is 1000 bytes (a body may be 800), whose model
    answers once ``go`` is set."""
    settings = SimpleNamespace(max_body_bytes=800)
    state = SimpleNamespace(settings=settings, bodies=BodyBudget(1000), transfer=None)
    go = asyncio.Event()

    async def prepare_with(state: Any, model: str, version: Any, parse: Any, heavy: bool) -> Any:
        return SimpleNamespace(parsed=None, decoupled=False)

    async def execute(state: Any, prepared: Any, big: bool, encode: Any) -> bytes:
        await go.wait()
        return b"{}"

    monkeypatch.setattr(generate_routes, "prepare_with", prepare_with)
    monkeypatch.setattr(generate_routes, "execute", execute)
    return state, go


@pytest.mark.parametrize("route", [generate_routes.generate, generate_routes.generate_stream])
async def test_bodies_held_at_once_are_bounded_by_the_process_budget(
    gateway: tuple[Any, asyncio.Event], route: Any
) -> None:
    state, go = gateway
    first = asyncio.create_task(route(request(state, b'{"x": "' + b"a" * 591 + b'"}'), "m"))
    await asyncio.sleep(0.01)
    assert state.bodies.held == 600
    with pytest.raises(ServerBusy, match="SLUICE_MAX_BUFFERED_BODY_BYTES"):
        await route(request(state, b'{"y": "' + b"b" * 591 + b'"}'), "m")
    assert state.bodies.held == 600
    go.set()
    assert (await first).status_code == 200
    assert state.bodies.held == 0


async def test_a_body_of_many_json_elements_is_parsed_on_a_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As a JSON ``/infer`` body: past a few KiB of JSON (read element by element), the
    parse goes to a thread rather than holding the event loop."""
    state = SimpleNamespace(
        settings=SimpleNamespace(max_body_bytes=1 << 20), bodies=BodyBudget(1 << 21), transfer=None
    )
    asked: list[bool] = []

    async def prepare_with(state: Any, model: str, version: Any, parse: Any, heavy: bool) -> Any:
        asked.append(heavy)
        return SimpleNamespace(parsed=None, decoupled=False)

    async def execute(state: Any, prepared: Any, big: bool, encode: Any) -> bytes:
        return b"{}"

    monkeypatch.setattr(generate_routes, "prepare_with", prepare_with)
    monkeypatch.setattr(generate_routes, "execute", execute)
    many = b'{"x": [' + b",".join([b'""'] * 4000) + b"]}"  # (12 KB, far below 64 KiB)
    for body in (b'{"x": "a"}', many):
        assert (await generate_routes.generate(request(state, body), "m")).status_code == 200
    assert asked == [False, True]
