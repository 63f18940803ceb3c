"""TorchServe's ``POST /workflows`` (sluice.gateway.torchserve.workflows) with its models'
registration stood in for: two gateway processes registering the same workflow at once, and
a node whose model is served already."""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace
from typing import Any, cast

import pytest
from fastapi import Request, Response

from sluice.core.torchserve.workflows import WorkflowArchive
from sluice.gateway.torchserve import workflows

SPEC = "models:\n  a: {url: a.mar}\n  b: {url: b.mar}\ndag:\n  a: [b]\n"


class Hash:
    """The few hash commands of Redis the workflows use, on one hash."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    async def hsetnx(self, key: str, name: str, value: bytes | str) -> bool:
        if name in self.data:
            return False
        self.data[name] = value.encode() if isinstance(value, str) else value
        return True

    async def hset(self, key: str, name: str, value: bytes | str) -> int:
        self.data[name] = value.encode() if isinstance(value, str) else value
        return 1

    async def hexists(self, key: str, name: str) -> bool:
        return name in self.data

    async def hget(self, key: str, name: str) -> bytes | None:
        return self.data.get(name)

    async def hdel(self, key: str, name: str) -> int:
        return 1 if self.data.pop(name, None) is not None else 0

    async def eval(self, script: str, keys: int, key: str, name: str, old: bytes, new: str) -> int:
        """The take-over script: replace ``old`` with ``new`` unless it changed."""
        if self.data.get(name) != old:
            return 0
        self.data[name] = new.encode()
        return 1


class Models:
    """The models' registration: each call waits for ``go``; what was done, in order."""

    def __init__(self) -> None:
        self.go = asyncio.Event()
        self.done: list[str] = []

    async def register(
        self, state: Any, params: dict[str, str], url: str, archive: Any, **options: Any
    ) -> Any:
        await self.go.wait()
        self.done.append(f"register {params['model_name']}")
        return Response(b"{}", 200)

    async def unload(self, state: Any, model: str) -> None:
        self.done.append(f"unload {model}")


@pytest.fixture
def stack(monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Models]:
    settings = SimpleNamespace(
        workflow_store=None, model_store=None, allowed_model_urls="", model_control_timeout_s=120.0
    )
    state = SimpleNamespace(
        redis=Hash(),
        keys=SimpleNamespace(torchserve_workflows="workflows"),
        settings=settings,
        view=SimpleNamespace(models={}),
    )
    models = Models()

    async def registration(request: Any) -> tuple[Any, dict[str, str], str]:
        return state, {"url": "w.war"}, "w.war"

    async def nothing(*args: Any) -> Any:
        return None

    async def war(url: str, store: Any, allowed: str) -> WorkflowArchive:
        return WorkflowArchive("w", SPEC, "", {})

    for name, value in [
        ("registration", registration),
        ("find_workflow", war),
        ("find_archive", nothing),
        ("register_archive", models.register),
        ("unload", models.unload),
    ]:
        monkeypatch.setattr(workflows, name, value)
    return state, models


def answer(response: Response) -> tuple[int, str]:
    body = json.loads(bytes(response.body))
    return response.status_code, body.get("status") or body["message"]


async def test_the_same_workflow_registered_twice_at_once_is_registered_once(
    stack: tuple[Any, Models],
) -> None:
    state, models = stack
    request = cast(Request, None)
    first = asyncio.create_task(workflows.register(request))
    second = asyncio.create_task(workflows.register(request))
    await asyncio.sleep(0.05)
    models.go.set()
    answers = sorted([answer(await first), answer(await second)])
    assert answers == [
        (200, "Workflow w has been registered and scaled successfully."),
        (409, "Workflow w is already registered."),
    ]
    assert not [step for step in models.done if step.startswith("unload")], models.done
    assert json.loads(state.redis.data["w"])["name"] == "w"


async def test_a_node_whose_model_is_served_already_fails_and_leaves_it_be(
    stack: tuple[Any, Models],
) -> None:
    state, models = stack
    state.view.models["w__b"] = SimpleNamespace(error="", versions={1: "1.0"}, config=object())
    models.go.set()
    code, message = answer(await workflows.register(cast(Request, None)))
    assert code == 500 and "Model w__b is already registered." in message, message
    assert models.done == ["register w__a", "unload w__a"]
    assert "w" not in state.redis.data


@pytest.mark.parametrize(("age_s", "code"), [(-60, 409), (3600, 200)])
async def test_a_claim_left_by_a_registration_that_died_lapses(
    stack: tuple[Any, Models], monkeypatch: pytest.MonkeyPatch, age_s: float, code: int
) -> None:
    """A gateway process that died while it registered left the name claimed, and one of
    its models registered: within the claim's time the name is taken (409); after it,
    another registration takes it over, unregisters what the dead one left, and registers
    the workflow whole."""
    state, models = stack
    until = time.time() - age_s
    state.redis.data["w"] = f"{workflows.REGISTERING} {until:.0f} w__a,w__b".encode()
    state.view.models["w__a"] = SimpleNamespace(error="", versions={1: "1.0"}, config=object())

    async def unload(state_: Any, model: str) -> None:
        models.done.append(f"unload {model}")
        state.view.models.pop(model, None)

    monkeypatch.setattr(workflows, "unload", unload)
    models.go.set()
    assert answer(await workflows.register(cast(Request, None)))[0] == code
    if code == 409:
        assert models.done == []
        return
    assert models.done == ["unload w__a", "register w__a", "register w__b"]
    assert json.loads(state.redis.data["w"])["name"] == "w"
