"""A TorchServe workflow's run (sluice.gateway.torchserve.workflow_run) with its nodes'
calls stood in for: which failures are tried again, what a node may be given, and the JSON
answer of several leaves."""

from __future__ import annotations

import json
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any, cast

import pytest

from sluice.core.errors import InferenceFailed, NotFound, PayloadTooLarge, SluiceError
from sluice.core.torchserve.workflows import Workflow, WorkflowArchive, parse_workflow
from sluice.gateway.state import GatewayState
from sluice.gateway.torchserve import workflow_run

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
    answer = await workflow_run.run(STATE, graph, (b"x", "text/plain"))
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
