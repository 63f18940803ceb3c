"""TorchServe's inference routes (``POST /predictions/{model}``, ``/explanations/{model}``,
``/wfpredict/{name}``) hold their clients' bodies within the gateway process's budget
(``SLUICE_MAX_BUFFERED_BODY_BYTES``), as the v2 routes do: a flood of large bodies is
refused (503) instead of exhausting the host's memory, and a body's bytes go back to the
budget once its request is answered."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Coroutine
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi import Request, Response
from starlette.types import Message

from sluice.core.torchserve.workflows import WorkflowArchive, parse_workflow
from sluice.gateway.body_budget import BodyBudget
from sluice.gateway.torchserve import routes, workflow_run

Route = Callable[[Request], Coroutine[Any, Any, Response]]


def request(state: Any, path: str, body: bytes, *, declared: bool = True) -> Request:
    """A POST of ``body`` to ``path`` (with its Content-Length, unless not ``declared``:
    then chunked)."""
    headers = [(b"content-length", str(len(body)).encode())] if declared else []
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> Message:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    app = SimpleNamespace(state=SimpleNamespace(sluice=state))
    scope = {
        "type": "http",
        "method": "POST",
        "path": path,
        "headers": headers,
        "query_string": b"",
        "app": app,
    }
    return Request(scope, receive)


@pytest.fixture
def gateway(monkeypatch: pytest.MonkeyPatch) -> tuple[Any, asyncio.Event]:
    """A gateway process whose body budget is 1000 bytes (a body may be 800), whose model
    and workflow calls answer once ``go`` is set."""
    state = SimpleNamespace(settings=SimpleNamespace(max_body_bytes=800), bodies=BodyBudget(1000))
    go = asyncio.Event()
    spec = WorkflowArchive("w", "models:\n  a: {url: a.mar}\ndag:\n  a: []\n", "", {})

    async def predict(
        state: Any, model: str, version: Any, body: bytes, kind: str, **_: Any
    ) -> Any:
        await go.wait()
        return b"ok", "text/plain"

    async def predict_answer(*args: Any, **kwargs: Any) -> routes.HandlerAnswer:
        body, media = await predict(*args, **kwargs)
        return routes.HandlerAnswer(body, media, 200)

    async def registered(state: Any, name: str) -> Any:
        return parse_workflow(spec, "w.war")

    monkeypatch.setattr(routes, "predict_answer", predict_answer)
    monkeypatch.setattr(workflow_run, "predict", predict)
    monkeypatch.setattr(workflow_run, "registered", registered)
    return state, go


ROUTES: list[tuple[str, Route]] = [
    ("/predictions/m", lambda r: routes.predictions(r, "m")),
    ("/explanations/m", lambda r: routes.explanations(r, "m")),
    ("/wfpredict/w", lambda r: workflow_run.wfpredict(r, "w")),
]


@pytest.mark.parametrize(("path", "route"), ROUTES)
@pytest.mark.parametrize("declared", [True, False])
async def test_bodies_held_at_once_are_bounded_by_the_process_budget(
    gateway: tuple[Any, asyncio.Event], path: str, route: Route, declared: bool
) -> None:
    state, go = gateway
    first = asyncio.create_task(route(request(state, path, b"x" * 600, declared=declared)))
    await asyncio.sleep(0.01)
    assert state.bodies.held == 600
    refused = await route(request(state, path, b"y" * 600, declared=declared))
    assert refused.status_code == 503, refused.body
    assert "SLUICE_MAX_BUFFERED_BODY_BYTES" in json.loads(bytes(refused.body))["message"]
    go.set()
    assert (await first).status_code == 200
    assert state.bodies.held == 0
