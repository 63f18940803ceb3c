"""A TorchServe workflow's run (sluice.gateway.torchserve.workflow_run) with its nodes'
calls stood in for: which failures are tried again, what a node may be given, and the JSON
answer of several leaves."""

from __future__ import annotations

import json
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any, cast

import pytest

from sluice.core.errors import (
    HandlerFailed,
    InferenceFailed,
    NotFound,
    Overloaded,
    PayloadTooLarge,
    SluiceError,
)
from sluice.core.tenants import CURRENT_TENANT
from sluice.core.torchserve.workflows import Workflow, WorkflowArchive, parse_workflow
from sluice.gateway.state import GatewayState
from sluice.gateway.torchserve import routes, workflow_run

STATE = cast(GatewayState, SimpleNamespace(settings=SimpleNamespace(max_body_bytes=1000)))


def workflow(dag: str, retries: int = 2) -> Workflow:
    spec = f"models:\n  retry-attempts: {retries}\ndag:\n{dag}"
    return parse_workflow(WorkflowArchive("w", spec, "h.py", {}), "w.war")


def stand_in(monkeypatch: pytest.MonkeyPatch, answer: Callable[[str, bytes], bytes]) -> list[str]:
    """Each node's call answers ``answer(node, body)``; the nodes called, in order."""
    called: list[str] = []

    async def predict(
        state: Any, model: str, version: Any, body: bytes, kind: str
    ) -> tuple[bytes, str]:
        node = model.removeprefix("w__")
        called.append(node)
        return answer(node, body), "application/json"

    monkeypatch.setattr(workflow_run, "predict", predict)
    return called


def raising(error: SluiceError) -> Callable[[str, bytes], bytes]:
    def answer(node: str, body: bytes) -> bytes:
        raise error

    return answer


async def test_a_client_error_is_not_tried_again_and_keeps_its_status(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    called = stand_in(monkeypatch, raising(NotFound("Model not found: w__a")))
    with pytest.raises(NotFound) as failed:
        await workflow_run.run(STATE, workflow("  a: []\n"), (b"x", "text/plain"))
    assert called == ["a"]
    assert failed.value.message == "Error executing a (Model not found: w__a)"


async def test_a_server_error_is_tried_again_as_the_node_says(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    called = stand_in(monkeypatch, raising(InferenceFailed("the handler failed")))
    with pytest.raises(InferenceFailed, match=r"^Error executing a \(the handler failed\)$"):
        await workflow_run.run(STATE, workflow("  a: []\n", retries=2), (b"x", "text/plain"))
    assert called == ["a", "a", "a"]


async def test_a_handler_s_failure_is_the_node_s_whatever_its_code(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A ``PredictionException(msg, 422)`` fails its request 422 on ``/predictions``; in a
    workflow TorchServe takes any error the node's worker reports for the node's failure:
    tried again, then the run's 500."""
    called = stand_in(monkeypatch, raising(HandlerFailed("no such word", 422)))
    with pytest.raises(InferenceFailed) as failed:
        await workflow_run.run(STATE, workflow("  a: []\n", retries=1), (b"x", "text/plain"))
    assert called == ["a", "a"]
    assert not isinstance(failed.value, HandlerFailed) and failed.value.status == 500
    assert failed.value.message == "Error executing a (no such word)"


async def test_a_status_a_node_s_handler_sets_is_not_the_run_s(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """TorchServe's workflow takes a node's body alone: the answer a handler gave with
    ``context.set_response_status(404, ...)`` goes on to the next node, and the run answers
    the last node's answer (200)."""
    given: list[bytes] = []

    async def predict_answer(
        state: Any, model: str, version: Any, body: bytes, kind: str, *, explain: bool = False
    ) -> routes.HandlerAnswer:
        given.append(body)
        if model == "w__a":
            return routes.HandlerAnswer(b"not here", "text/plain", 404)
        return routes.HandlerAnswer(b"after " + body, "text/plain", 200)

    monkeypatch.setattr(routes, "predict_answer", predict_answer)
    answer = await workflow_run.run(STATE, workflow("  a: [b]\n"), (b"x", "text/plain"))
    assert given == [b"x", b"not here"]
    assert answer == b"after not here"


async def test_parents_answering_more_than_a_body_may_hold_are_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    called = stand_in(monkeypatch, lambda node, body: b"x" * 600)
    graph = workflow("  a: [b, c]\n  b: [d]\n  c: [d]\n")
    with pytest.raises(PayloadTooLarge, match=r"Error executing d .*1200 bytes"):
        await workflow_run.run(STATE, graph, (b"x", "text/plain"))
    assert "d" not in called


LEAVES = {
    "b": b'{"price": 0.10000000000000000555, "id": 12345678901234567890123}',
    "c": b"NaN",
    "d": b"[" * 100_000 + b"]" * 100_000,
    "e": b"plain text",
}


async def test_several_leaves_answer_each_answer_as_it_came_in_valid_json(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    stand_in(monkeypatch, lambda node, body: LEAVES.get(node, b"start"))
    graph = workflow("  a: [b, c, d, e]\n")
    state = cast(GatewayState, SimpleNamespace(settings=SimpleNamespace(max_body_bytes=1 << 20)))
    answer = await workflow_run.run(state, graph, (b"x", "text/plain"))
    assert answer.startswith(b'{"b": ' + LEAVES["b"] + b', "c": "NaN", "d": "[[[')
    merged = json.loads(answer, parse_constant=lambda name: pytest.fail(f"{name} in JSON"))
    assert (merged["c"], merged["e"]) == ("NaN", "plain text")
    assert merged["d"] == LEAVES["d"].decode()


async def test_a_leaf_answering_bytes_that_are_no_text_fails_the_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    stand_in(monkeypatch, lambda node, body: b"\xff\xfe\x00" if node == "c" else b"1")
    with pytest.raises(InferenceFailed, match=r"Error executing c .*neither JSON nor UTF-8"):
        await workflow_run.run(STATE, workflow("  a: [b, c]\n"), (b"x", "text/plain"))


async def test_leaves_answering_more_than_a_body_may_hold_are_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Several leaves' answers make one JSON object (each answer parsed to see whether it is
    JSON): their bytes together are bounded as a node's input is, not held and parsed
    whatever their size."""
    stand_in(monkeypatch, lambda node, body: b"[]" * 300 if node != "a" else b"start")
    with pytest.raises(PayloadTooLarge, match=r"1200 bytes"):
        await workflow_run.run(STATE, workflow("  a: [b, c]\n"), (b"x", "text/plain"))


async def test_a_node_refused_for_a_full_queue_is_not_tried_again_and_keeps_its_status(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An overloaded model refuses at once and says to retry later: trying again at once
    only adds to its load, and the client is owed its 503, not a 500."""
    called = stand_in(monkeypatch, raising(Overloaded("model 'w__a' has a full queue")))
    with pytest.raises(Overloaded, match=r"^Error executing a \(model 'w__a' has a full queue\)$"):
        await workflow_run.run(STATE, workflow("  a: []\n", retries=3), (b"x", "text/plain"))
    assert called == ["a"]


async def test_every_node_is_called_as_the_caller_s_tenant(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The nodes' calls (tasks of their own, side by side) count against the limits and
    the queue share of the tenant whose key called the workflow."""
    seen: dict[str, str] = {}

    def answer(node: str, body: bytes) -> bytes:
        seen[node] = CURRENT_TENANT.get()
        return b"1"

    stand_in(monkeypatch, answer)
    token = CURRENT_TENANT.set("acme")
    try:
        await workflow_run.run(STATE, workflow("  a: [b, c]\n  b: [d]\n"), (b"x", "text/plain"))
    finally:
        CURRENT_TENANT.reset(token)
    assert seen == dict.fromkeys("abcd", "acme")
