"""The generate extension's routes against what a client may send or do: a request asking
for binary outputs (the generate answer is JSON only) and a streaming client that goes away
before its first response."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from sluice.gateway.body_budget import BodyBudget
from sluice.gateway.http import generate_routes
from sluice.gateway.http.protocol import CANCEL_ON_DISCONNECT
from tests.support.onnx_models import identity_config
from tests.unit.gateway.http.test_generate_bodies import request
from tests.unit.gateway.in_process import EchoDispatcher, in_process_gateway


@pytest.mark.parametrize("route", ["generate", "generate_stream"])
@pytest.mark.parametrize(
    "body",
    [
        {"IN_FP32": [1.5, 2], "binary_data_output": True},
        {"IN_FP32": [1.5, 2], "parameters": {"binary_data_output": True}},
    ],
)
async def test_asking_for_binary_outputs_still_gets_the_json_answer(
    route: str, body: dict[str, Any]
) -> None:
    """It was a 500 ("an output cannot be written as JSON") for a request any client may
    send; Triton's generate answers JSON whatever the request's parameters."""
    fast = in_process_gateway(
        "echo", identity_config("echo", ["FP32"], [-1], 8), EchoDispatcher(["OUT_FP32"])
    )
    fast.app.include_router(generate_routes.router)
    transport = httpx.ASGITransport(app=fast)
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
        answer = await client.post(f"/v2/models/echo/{route}", json=body)
    assert answer.status_code == 200, answer.text
    assert '"OUT_FP32":[1.5,2.0]' in answer.text


async def test_a_stream_client_gone_before_the_first_response_takes_its_request_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A decoupled model's first response may be long in coming: a client that goes away
    meanwhile cancels the route (as on ``/generate``), so its request is withdrawn and its
    body's bytes given back, instead of computed for nobody."""
    state = SimpleNamespace(
        settings=SimpleNamespace(max_body_bytes=800), bodies=BodyBudget(1000), transfer=None
    )
    withdrawn = asyncio.Event()

    async def prepare_with(state: Any, model: str, version: Any, parse: Any, heavy: bool) -> Any:
        return SimpleNamespace(parsed=None, decoupled=True)

    async def execute_stream(
        state: Any, prepared: Any, big: bool, encode: Any
    ) -> AsyncIterator[tuple[Any, bytes]]:
        try:
            await asyncio.Event().wait()  # (the first response never comes)
            yield None, b"{}"
        finally:
            withdrawn.set()

    monkeypatch.setattr(generate_routes, "prepare_with", prepare_with)
    monkeypatch.setattr(generate_routes, "execute_stream", execute_stream)
    asked = request(state, b'{"x": "a"}')
    task = asyncio.create_task(generate_routes.generate_stream(asked, "m"))
    await asyncio.sleep(0.01)
    assert state.bodies.held > 0
    # What the HTTP protocol does when the connection is lost before the response starts.
    assert asked.scope.get(CANCEL_ON_DISCONNECT) is task
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert withdrawn.is_set()
    assert state.bodies.held == 0
