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

from sluice.core.errors import NotFound, Unavailable
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

    async def hgetall(self, key: str) -> dict[bytes, bytes]:
        return {name.encode(): value for name, value in self.data.items()}

    async def hdel(self, key: str, name: str) -> int:
        return 1 if self.data.pop(name, None) is not None else 0

    async def eval(self, script: str, keys: int, key: str, name: str, *args: bytes | str) -> int:
        """The scripts: replace ``args[0]`` with ``args[1]`` (or delete it, given no
        ``args[1]``) unless it changed."""
        old, *new = (a.encode() if isinstance(a, str) else a for a in args)
        if self.data.get(name) != old:
            return 0
        if new:
            self.data[name] = new[0]
        else:
            del self.data[name]
        return 1


class Models:
    """The models' registration: each call waits for ``go``; what was done, in order."""

    def __init__(self) -> None:
        self.go = asyncio.Event()
        self.unloads = asyncio.Event()
        self.unloads.set()
        self.unfinished: set[str] = set()
        """Models whose registration ends before their load is seen to."""
        self.failing: set[str] = set()
        """Models whose unregistration fails."""
        self.done: list[str] = []

    async def register(
        self, state: Any, params: dict[str, str], url: str, archive: Any, **options: Any
    ) -> Any:
        await self.go.wait()
        model = params["model_name"]
        if model in self.unfinished:
            raise Unavailable(f"the load of '{model}' did not finish")
        self.done.append(f"register {model}")
        return Response(b"{}", 200)

    async def unload(self, state: Any, model: str) -> None:
        await self.unloads.wait()
        if model in self.failing:
            raise Unavailable(f"the unload of '{model}' did not finish")
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

    async def current_state(request: Any) -> Any:
        return state

    for name, value in [
        ("current_state", current_state),
        ("require_explicit", nothing),
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


async def test_a_registration_cancelled_midway_leaves_its_claim_to_lapse(
    stack: tuple[Any, Models],
) -> None:
    """A registration cancelled (its gateway process stopping) while its nodes register may
    leave models registered (a load already handed to ``sluice up`` goes on): freeing the
    name would leave them to refuse every later registration of the workflow. Its claim
    stays, naming them, for the registration that takes it over once it lapses."""
    state = stack[0]
    task = asyncio.create_task(workflows.register(cast(Request, None)))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    held = state.redis.data["w"].decode()
    assert held.startswith(workflows.REGISTERING) and held.endswith(" w__a,w__b"), held


COLLIDING = {
    "a.war": "models:\n  b__c: {url: c.mar}\ndag:\n  b__c: []\n",
    "a__b.war": "models:\n  c: {url: c.mar}\ndag:\n  c: []\n",
}


@pytest.fixture
def colliding(stack: tuple[Any, Models], monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Models]:
    """Each request is the URL it registers: workflow ``a`` (node ``b__c``) or ``a__b``
    (node ``c``), whose nodes are both served as model ``a__b__c``."""
    state, models = stack

    async def registration(request: Any) -> tuple[Any, dict[str, str], str]:
        return state, {"url": request}, request

    async def war(url: str, store: Any, allowed: str) -> WorkflowArchive:
        return WorkflowArchive(url.removesuffix(".war"), COLLIDING[url], "", {})

    monkeypatch.setattr(workflows, "registration", registration)
    monkeypatch.setattr(workflows, "find_workflow", war)
    models.go.set()
    return state, models


async def test_a_node_model_of_another_workflow_is_refused_though_not_served(
    colliding: tuple[Any, Models],
) -> None:
    """Workflow ``a``'s node ``b__c`` and workflow ``a__b``'s node ``c`` are one model: once
    ``a`` holds it (its model unregistered by hand meanwhile, so not served), ``a__b`` may
    not take it, or each workflow would run and unregister the other's."""
    state, models = colliding
    assert answer(await workflows.register(cast(Request, "a.war")))[0] == 200
    code, message = answer(await workflows.register(cast(Request, "a__b.war")))
    assert code == 500 and "Model a__b__c is already registered" in message, message
    assert "a__b" not in state.redis.data
    assert models.done == ["register a__b__c"]


async def test_two_workflows_of_one_node_model_registered_at_once_do_not_share_it(
    colliding: tuple[Any, Models],
) -> None:
    models = colliding[1]
    first = asyncio.create_task(workflows.register(cast(Request, "a.war")))
    second = asyncio.create_task(workflows.register(cast(Request, "a__b.war")))
    codes = [answer(await first)[0], answer(await second)[0]]
    assert codes.count(200) <= 1, codes
    assert models.done.count("register a__b__c") == codes.count(200), models.done


async def registered_workflow(stack: tuple[Any, Models]) -> None:
    stack[1].go.set()
    assert answer(await workflows.register(cast(Request, None)))[0] == 200


async def test_a_workflow_being_unregistered_is_gone_and_its_name_taken_until_it_is(
    stack: tuple[Any, Models],
) -> None:
    """While its nodes are unregistered the workflow runs no more, and its name is not
    registered again (nor unregistered twice) before they all are."""
    state, models = stack
    await registered_workflow(stack)
    models.unloads.clear()
    deleting = asyncio.create_task(workflows.unregister(cast(Request, None), "w"))
    await asyncio.sleep(0.05)
    with pytest.raises(NotFound):
        await workflows.registered(state, "w")
    assert answer(await workflows.unregister(cast(Request, None), "w"))[0] == 404
    assert answer(await workflows.register(cast(Request, None))) == (
        409,
        "Workflow w is already registered.",
    )
    models.unloads.set()
    assert answer(await deleting) == (200, 'Workflow "w" unregistered')
    assert "w" not in state.redis.data
    assert answer(await workflows.register(cast(Request, None)))[0] == 200


async def test_an_unregistration_cancelled_midway_leaves_its_models_named(
    stack: tuple[Any, Models],
) -> None:
    """An unregistration cancelled (its gateway process stopping) before its nodes are all
    unregistered leaves a claim naming them, which lapses: the workflow's next registration
    takes it over and unregisters what is left, instead of finding models nobody names."""
    state, models = stack
    await registered_workflow(stack)
    models.unloads.clear()
    deleting = asyncio.create_task(workflows.unregister(cast(Request, None), "w"))
    await asyncio.sleep(0.05)
    deleting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await deleting
    held = state.redis.data["w"].decode()
    assert held.startswith(workflows.REGISTERING) and held.endswith(" w__a,w__b"), held


async def test_an_unregistration_that_fails_leaves_the_workflow_to_unregister_again(
    stack: tuple[Any, Models],
) -> None:
    state, models = stack
    await registered_workflow(stack)
    models.failing.add("w__b")
    code, message = answer(await workflows.unregister(cast(Request, None), "w"))
    assert code == 500 and "Error while unregistering workflow node w__b" in message, message
    assert (await workflows.registered(state, "w")).name == "w"
    models.failing.clear()
    assert answer(await workflows.unregister(cast(Request, None), "w"))[0] == 200
    assert "w" not in state.redis.data


async def test_a_node_whose_load_was_not_seen_to_end_is_unregistered_with_the_others(
    stack: tuple[Any, Models],
) -> None:
    """A load that outlasted the registration's wait goes on in ``sluice up``: when the
    registration fails, that node's model is unregistered too, or it would be left served,
    refusing every later registration of the workflow."""
    state, models = stack
    models.unfinished.add("w__b")
    models.go.set()
    code, message = answer(await workflows.register(cast(Request, None)))
    assert code == 500 and "the load of 'w__b' did not finish" in message, message
    assert sorted(models.done) == ["register w__a", "unload w__a", "unload w__b"]
    assert "w" not in state.redis.data


async def test_a_failed_registration_whose_models_stay_leaves_its_claim_naming_them(
    stack: tuple[Any, Models],
) -> None:
    state, models = stack
    models.unfinished.update({"w__a", "w__b"})
    models.failing.update({"w__a", "w__b"})
    models.go.set()
    code, message = answer(await workflows.register(cast(Request, None)))
    assert code == 500 and "Error while unregistering workflow node w__a" in message, message
    held = state.redis.data["w"].decode()
    assert held.startswith(workflows.REGISTERING) and held.endswith(" w__a,w__b"), held
