"""TorchServe's workflows on a real stack in explicit model control: archives made by the
real ``torch-workflow-archiver`` and ``torch-model-archiver``, registered through
``POST /workflows``, run through ``POST /wfpredict`` (a model node and function nodes, in
sequence and side by side), described, listed and unregistered with TorchServe's answers;
bad archives refused with nothing left registered."""

from __future__ import annotations

import zipfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from sluice.scheduler.executor.redis_server import RedisServer
from tests.support.stack import Stack
from tests.support.torchserve_archives import (
    make_archive,
    make_workflow,
    said,
    store_stack,
)

SHOUT = '''
def handle(data, context):
    """Text in, in capitals out."""
    if data is None:
        return None
    return [bytes(request["body"]).decode().upper() for request in data]
'''

FUNCTIONS = '''
import json


def pre(data, context):
    """The client's text (str: it came as text/plain), with a suffix from an extra file.
    (TorchServe calls each function once with no data when it loads it.)"""
    if not data:
        return None
    with open("suffix.txt") as f:
        suffix = f.read().strip()
    return [request["body"] + suffix for request in data]


def count(data, context):
    """The length of what ``pre`` answered (it arrives as bytes)."""
    if not data:
        return None
    return [str(len(request["body"])) for request in data]


def join(data, context):
    """Two parents: one part each, by the parent's name."""
    if not data:
        return None
    return [
        json.dumps({"text": bytes(r["shout"]).decode(), "length": int(bytes(r["count"]))})
        for r in data
    ]


def fail(data, context):
    if data:
        raise ValueError("no")
'''

TEXT = {"content-type": "text/plain"}

PARALLEL = """
models:
  min-workers: 1
  batch-size: 4
  max-batch-delay: 10
  shout:
    url: shout.mar
    max-workers: 3
dag:
  pre: [shout, count]
  shout: [join]
  count: [join]
"""


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("workflows")
    store = tmp / "store"
    make_archive(store, "shout", SHOUT)
    make_workflow(store, "words", PARALLEL, FUNCTIONS, extra={"suffix.txt": "!\n"})
    sequence = "models:\n  shout:\n    url: shout.mar\ndag:\n  pre: [shout]\n"
    make_workflow(store, "line", sequence, FUNCTIONS, extra={"suffix.txt": "?\n"})
    make_workflow(store, "broken", "dag:\n  pre: [fail]\n", FUNCTIONS, extra={"suffix.txt": ""})
    make_workflow(store, "loop", "dag:\n  pre: [a]\n  a: [b]\n  b: [a]\n", FUNCTIONS)
    make_workflow(store, "missing", "models:\n  m:\n    url: nowhere.mar\ndag:\n  pre: [m]\n", "")
    stack = store_stack(tmp, redis_server.url, store)
    stack.start()
    yield stack
    stack.stop()


def test_a_workflow_is_registered_run_described_and_unregistered(stack: Stack) -> None:
    with httpx.Client(base_url=stack.url, timeout=180) as http:
        registered = http.post("/workflows", params={"url": "words.war"})
        assert said(registered, 200) == (
            "Workflow words has been registered and scaled successfully."
        )
        again = http.post("/workflows", params={"url": "words.war"})
        assert said(again, 409) == "Workflow words is already registered."

        answer = http.post(
            "/wfpredict/words", content="hey", headers={"content-type": "text/plain"}
        )
        assert answer.status_code == 200, answer.text
        assert answer.json() == {"text": "HEY!", "length": 4}
        # Each node is a model of its own, named <workflow>__<node>.
        assert http.post("/predictions/words__shout", content="a").text == "A"
        (shout,) = http.get("/models/words__shout").json()
        assert (shout["minWorkers"], shout["maxWorkers"], shout["batchSize"]) == (1, 3, 4)
        models = {m["modelName"] for m in http.get("/models").json()["models"]}
        assert {"words__pre", "words__shout", "words__count", "words__join"} <= models

        (described,) = http.get("/workflows/words").json()
        assert described == {
            "workflowName": "words",
            "workflowUrl": "words.war",
            "minWorkers": 1,
            "maxWorkers": 1,
            "batchSize": 4,
            "maxBatchDelay": 10,
            "workflowDag": "{pre=[shout, count], shout=[join], count=[join], join=[]}",
        }
        listed = http.get("/workflows").json()
        assert {"workflowName": "words", "workflowUrl": "words.war"} in listed["workflows"]

        gone = http.delete("/workflows/words")
        assert said(gone, 200) == 'Workflow "words" unregistered'
        assert said(http.post("/wfpredict/words", content="x"), 404) == (
            "Workflow not found: words"
        )
        assert said(http.get("/workflows/words"), 404) == "Workflow not found: words"
        models = {m["modelName"] for m in http.get("/models").json()["models"]}
        assert not {m for m in models if m.startswith("words__")}


def test_a_sequence_answers_with_its_last_node_and_a_name_may_be_given(stack: Stack) -> None:
    with httpx.Client(base_url=stack.url, timeout=180) as http:
        named = http.post("/workflows", params={"url": "line.war", "workflow_name": "asking"})
        assert "Workflow asking has been registered" in said(named, 200)
        answer = http.post(
            "/wfpredict/asking", content="why", headers={"content-type": "text/plain"}
        )
        assert (answer.status_code, answer.text) == (200, "WHY?")
        assert answer.headers["content-type"] == "application/json"
        assert said(http.delete("/workflows/asking"), 200) == 'Workflow "asking" unregistered'


def test_a_node_that_fails_fails_the_run_naming_it(stack: Stack) -> None:
    with httpx.Client(base_url=stack.url, timeout=180) as http:
        said(http.post("/workflows", params={"url": "broken.war"}), 200)
        failed = http.post("/wfpredict/broken", content="x", headers=TEXT)
        message = said(failed, 500)
        assert message.startswith("Error executing fail"), message
        # TorchServe's text for a handler that raised (the exception goes to the worker's log).
        assert "Prediction failed" in message
        said(http.delete("/workflows/broken"), 200)


@pytest.mark.parametrize(
    ("url", "code", "text"),
    [
        ("loop.war", 400, "Invalid workflow specification: Not a valid DAG"),
        ("nowhere.war", 404, "Workflow not found in workflow store: nowhere.war"),
        ("../words.war", 404, "Relative path is not allowed in url: ../words.war"),
        ("x" * 300 + ".war", 404, "Workflow not found in workflow store: xxx"),
        ("missing.war", 500, "Workflow missing has failed to register. Failures: [Workflow Node"),
    ],
)
def test_what_cannot_be_registered_is_refused_and_leaves_nothing(
    stack: Stack, url: str, code: int, text: str
) -> None:
    with httpx.Client(base_url=stack.url, timeout=180) as http:
        assert said(http.post("/workflows", params={"url": url}), code).startswith(text)
        names = [w["workflowName"] for w in http.get("/workflows").json()["workflows"]]
        assert url.removesuffix(".war").lstrip("./") not in names
        models = {m["modelName"] for m in http.get("/models").json()["models"]}
        prefix = url.removesuffix(".war").lstrip("./") + "__"
        assert not {m for m in models if m.startswith(prefix)}


def test_an_archive_whose_entries_leave_it_is_refused(stack: Stack, tmp_path: Path) -> None:
    store = Path(stack.env["SLUICE_MODEL_STORE"])
    with zipfile.ZipFile(store / "slip.war", "w") as war:
        war.writestr("WAR-INF/MANIFEST.json", '{"workflow": {"workflowName": "slip"}}')
        war.writestr("../../escape.py", "print('out')")
    with httpx.Client(base_url=stack.url, timeout=60) as http:
        message = said(http.post("/workflows", params={"url": "slip.war"}), 400)
        assert "points outside the archive" in message
    assert not (store.parent / "escape.py").exists()
