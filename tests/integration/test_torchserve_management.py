"""TorchServe's management API answering as TorchServe 0.12 does (its frontend's codes, as
its own API test collection expects them), on a real stack in explicit model control with a
model store of archives made by the real ``torch-model-archiver``: versions added beside
those served, the default version, scaling, and the registration parameters TorchServe
accepts, ignores or fails."""

from __future__ import annotations

import json
import time
import zipfile
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from sluice.core.torchserve.archives import MANIFEST
from sluice.scheduler.executor.redis_server import RedisServer
from tests.support.stack import Stack
from tests.support.torchserve_archives import make_archive, said, store_stack

ECHO_HANDLER = '''
def handle(data, context):
    """Text in, in capitals out, with the archive's version."""
    if data is None:
        return None
    version = context.manifest["model"]["modelVersion"]
    answers = []
    for request in data:
        body = request.get("body")
        text = body.decode() if isinstance(body, (bytes, bytearray)) else str(body)
        answers.append(f"{text.upper()} (v{version})")
    return answers
'''

GREETER_HANDLER = """
class Greeter:
    def initialize(self, context):
        with open("greeting.txt") as f:
            self.greeting = f.read().strip()

    def handle(self, data, context):
        return [self.greeting for _ in data]
"""


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("management")
    store = tmp / "store"
    make_archive(store, "shout", ECHO_HANDLER, version="1.0")
    make_archive(
        store,
        "shout",
        ECHO_HANDLER,
        version="2.0",
        archive_format="tgz",
        file_name="shout-v2.tar.gz",
    )
    make_archive(store, "shout", ECHO_HANDLER, version="2", file_name="shout-2.mar")
    # torch-model-archiver takes any text as --version, as TorchServe does.
    make_archive(store, "texty", ECHO_HANDLER, version="2024-01", file_name="texty-a.mar")
    make_archive(store, "texty", ECHO_HANDLER, version="v1/../2", file_name="texty-b.mar")
    make_archive(
        store,
        "greeter",
        GREETER_HANDLER,
        extra={"greeting.txt": "hello there\n"},
        config="batchSize: 3\nmaxBatchDelay: 15\nminWorkers: 1\nmaxWorkers: 2\n",
        archive_format="no-archive",
    )
    # A manifest edited by hand to a runtime TorchServe does not know.
    with (
        zipfile.ZipFile(store / "shout.mar") as made,
        zipfile.ZipFile(store / "no-runtime.mar", "w") as edited,
    ):
        for member in made.infolist():
            data = made.read(member)
            if member.filename == MANIFEST:
                data = json.dumps({**json.loads(data), "runtime": None}).encode()
            edited.writestr(member, data)
    stack = store_stack(tmp, redis_server.url, store)
    stack.start()
    yield stack
    stack.stop()


def test_a_second_version_is_added_beside_the_first_which_stays_the_default(stack: Stack) -> None:
    with httpx.Client(base_url=stack.url, timeout=120) as http:
        first = http.post("/models", params={"url": "shout.mar", "initial_workers": 1})
        assert said(first, 200) == 'Model "shout" Version: 1.0 registered with 1 initial workers'
        again = http.post("/models", params={"url": "shout.mar"})
        assert said(again, 409) == "Model version 1.0 is already registered for model shout"
        second = http.post("/models", params={"url": "shout-v2.tar.gz"})
        assert "Version: 2.0 registered" in said(second, 200)

        # TorchServe keys versions by their text: 2 is a version beside 2.0, not the same.
        third = http.post("/models", params={"url": "shout-2.mar"})
        assert said(third, 200).startswith('Model "shout" Version: 2 registered')
        assert http.post("/predictions/shout/2", content="hi").text == "HI (v2)"
        assert http.post("/predictions/shout/2.0", content="hi").text == "HI (v2.0)"
        assert said(http.delete("/models/shout/2"), 200) == 'Model "shout" unregistered'

        every = http.get("/models/shout/all").json()
        assert [(d["modelVersion"], d["modelUrl"]) for d in every] == [
            ("1.0", "shout.mar"),
            ("2.0", "shout-v2.tar.gz"),
        ]
        assert [d["modelVersion"] for d in http.get("/models/shout").json()] == ["1.0"]
        assert http.post("/predictions/shout", content="hi").text == "HI (v1.0)"
        assert http.post("/predictions/shout/2.0", content="hi").text == "HI (v2.0)"

        default = http.put("/models/shout/2.0/set-default")
        assert said(default, 200) == (
            'Default version successfully updated for model "shout" to "2.0"'
        )
        assert http.post("/predictions/shout", content="yo").text == "YO (v2.0)"
        kept = http.delete("/models/shout")
        assert said(kept, 403) == "Cannot remove default version for model shout"
        assert said(http.delete("/models/shout/1.0"), 200) == 'Model "shout" unregistered'
        assert [d["modelVersion"] for d in http.get("/models/shout/all").json()] == ["2.0"]
        assert http.post("/predictions/shout/1.0", content="x").status_code == 404
        assert http.post("/predictions/shout", content="yo").text == "YO (v2.0)"
        assert said(http.delete("/models/shout"), 200) == 'Model "shout" unregistered'
        assert http.get("/models/shout").status_code == 404


def test_any_version_text_registers_and_is_named_by_it(stack: Stack) -> None:
    """TorchServe takes any text as a version (``2024-01``); one with a path separator is
    refused, naming it (it would never be reachable in ``/models/{m}/{v}``)."""
    with httpx.Client(base_url=stack.url, timeout=120) as http:
        first = http.post("/models", params={"url": "texty-a.mar"})
        assert said(first, 200).startswith('Model "texty" Version: 2024-01 registered')
        (described,) = http.get("/models/texty/2024-01").json()
        assert (described["modelVersion"], described["modelUrl"]) == ("2024-01", "texty-a.mar")
        assert http.post("/predictions/texty/2024-01", content="hi").text == "HI (v2024-01)"
        refused = http.post("/models", params={"url": "texty-b.mar"})
        assert "model version 'v1/../2'" in said(refused, 400)
        assert refused.json()["type"] == "BadRequestException"
        assert [d["modelVersion"] for d in http.get("/models/texty/all").json()] == ["2024-01"]
        assert said(http.delete("/models/texty"), 200) == 'Model "texty" unregistered'


def test_scaling_answers_as_torchserve_does(stack: Stack) -> None:
    with httpx.Client(base_url=stack.url, timeout=120) as http:
        registered = http.post("/models", params={"url": "shout.mar", "model_name": "scaled"})
        said(registered, 200)
        for params, code, text in (
            ({"min_worker": 2, "max_worker": 1}, 400, "max_worker cannot be less than min_worker."),
            ({"max_worker": -1}, 400, "max_worker cannot be less than min_worker."),
            ({"min_worker": -1}, 400, "'min_worker' must be at least 0, got -1"),
        ):
            assert text in said(http.put("/models/scaled", params=params), code)
        missing = http.put("/models/scaled/0.0", params={"min_worker": 1, "synchronous": "true"})
        assert said(missing, 404) == "Model version: 0.0 does not exist for model: scaled"
        assert said(http.put("/models/elsewhere", params={"min_worker": 1}), 404) == (
            "Model not found: elsewhere"
        )
        (first,) = _settled_workers(http, "scaled", 1)
        synchronous = http.put("/models/scaled", params={"min_worker": 2, "synchronous": "true"})
        assert said(synchronous, 200) == "Workers scaled to 2 for model: scaled"
        (described,) = http.get("/models/scaled").json()
        assert (described["minWorkers"], described["maxWorkers"]) == (2, 2)
        # As TorchServe: the worker that served goes on serving (not restarted), one more
        # starts beside it; scaled down, one of them goes.
        two = _settled_workers(http, "scaled", 2)
        assert first["pid"] in {worker["pid"] for worker in two}, (first, two)
        down = http.put("/models/scaled", params={"min_worker": 1, "synchronous": "true"})
        assert said(down, 200) == "Workers scaled to 1 for model: scaled"
        assert _settled_workers(http, "scaled", 1) == [first]
        assert http.post("/predictions/scaled", content="ok").status_code == 200
        later = http.put("/models/scaled", params={"min_worker": "nan", "synchronous": "nan"})
        assert said(later, 202) == "Processing worker updates..."
        assert said(http.delete("/models/scaled"), 200) == 'Model "scaled" unregistered'


def _settled_workers(http: httpx.Client, model: str, count: int) -> list[dict[str, Any]]:
    """The model's workers once ``count`` are listed: a retired worker leaves the list a
    moment after the scale answered (it hands over what it held first)."""
    deadline = time.monotonic() + 30
    workers = http.get(f"/models/{model}").json()[0]["workers"]
    while len(workers) != count and time.monotonic() < deadline:
        time.sleep(0.1)
        workers = http.get(f"/models/{model}").json()[0]["workers"]
    assert len(workers) == count, workers
    return list(workers)


@pytest.mark.parametrize(
    ("params", "described"),
    [
        ({"batch_size": "dd", "initial_workers": 1}, {"batchSize": 1, "minWorkers": 1}),
        (
            {"batch_size": 2, "initial_workers": 1, "max_batch_delay": "junk"},
            {"batchSize": 2, "maxBatchDelay": 100},
        ),
        ({"initial_workers": -1}, {"minWorkers": 0, "maxWorkers": 1}),
        ({"startup_timeout": 0}, {"minWorkers": 1}),
        ({"runtime": "python3", "synchronous": "-1"}, {"runtime": "python3"}),
    ],
)
def test_registration_parameters_torchserve_takes_or_ignores(
    stack: Stack, params: dict[str, object], described: dict[str, object]
) -> None:
    with httpx.Client(base_url=stack.url, timeout=120) as http:
        registered = http.post("/models", params={"url": "shout.mar", "model_name": "p", **params})
        assert registered.status_code == 200, registered.text
        (description,) = http.get("/models/p").json()
        assert {key: description[key] for key in described} == described
        assert http.post("/predictions/p/1.0", content="ok").text == "OK (v1.0)"
        assert said(http.delete("/models/p/1.0"), 200) == 'Model "p" unregistered'


@pytest.mark.parametrize(
    ("params", "code", "text"),
    [
        ({"runtime": "python4"}, 400, "Invalid RuntimeType value: python4"),
        (
            {"startup_timeout": 0, "initial_workers": 3, "batch_size": 3},
            500,
            "Failed to start workers for model failing version: 1.0",
        ),
        ({"handler": "invalidHandler"}, 500, "Failed to start workers for model failing"),
        ({"url": ""}, 404, "empty url"),
        ({"url": "no-runtime.mar"}, 400, "no-runtime.mar: Runtime is not defined or invalid."),
    ],
)
def test_registrations_torchserve_fails_fail_alike_and_leave_nothing(
    stack: Stack, params: dict[str, object], code: int, text: str
) -> None:
    with httpx.Client(base_url=stack.url, timeout=120) as http:
        failed = http.post(
            "/models", params={"url": "shout.mar", "model_name": "failing", **params}
        )
        assert text in said(failed, code)
        assert set(failed.json()) == {"code", "type", "message"}
        assert said(http.get("/models/failing"), 404) == "Model not found: failing"


def test_a_model_folder_registers_with_its_model_config(stack: Stack) -> None:
    with httpx.Client(base_url=stack.url, timeout=120) as http:
        registered = http.post(
            "/models",
            json={"url": "greeter", "synchronous": True},
            headers={"content-type": "application/json"},
        )
        assert "registered with 1 initial workers" in said(registered, 200)
        (described,) = http.get("/models/greeter/1.0").json()
        assert (described["batchSize"], described["maxBatchDelay"]) == (3, 15)
        assert (described["minWorkers"], described["maxWorkers"]) == (1, 2)
        assert http.post("/predictions/greeter", content="hi").text == "hello there"
        missing = http.get("/models/greeter/0.0")
        assert said(missing, 404) == "Model version: 0.0 does not exist for model: greeter"
        missing = http.put("/models/greeter/0.0/set-default")  # (TorchServe's own words)
        assert said(missing, 404) == "Model version 0.0 does not exist for model greeter"
        assert said(http.delete("/models/greeter/0.0"), 404).startswith("Model version: 0.0")
        listed = http.get("/models", params={"limit": 1}).json()
        assert listed["models"][0]["modelName"] == "greeter"
        assert listed["models"][0]["modelUrl"] == "greeter"
        assert said(http.delete("/models/greeter"), 200) == 'Model "greeter" unregistered'


def test_an_asynchronous_registration_answers_at_once_and_loads_after(stack: Stack) -> None:
    with httpx.Client(base_url=stack.url, timeout=120) as http:
        params = {"url": "shout.mar", "model_name": "later", "initial_workers": 1}
        accepted = http.post("/models", params={**params, "synchronous": "false"})
        assert said(accepted, 202) == "Processing worker updates..."
        deadline = time.monotonic() + 60
        while http.get("/models/later").status_code == 404 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert http.post("/predictions/later", content="ok").text == "OK (v1.0)"
        assert said(http.delete("/models/later"), 200) == 'Model "later" unregistered'


def test_numbers_beyond_a_java_int_take_their_defaults_as_in_torchserve(stack: Stack) -> None:
    """TorchServe reads the query's numbers as Java ints, and one that is not (beyond its
    range too) takes its default. Here such a ``response_timeout`` overflowed the
    configuration: a 400 about config.pbtxt for a new model, a 500 for a version added."""
    huge = "1" + "0" * 30
    with httpx.Client(base_url=stack.url, timeout=120) as http:
        first = http.post(
            "/models",
            params={"url": "shout.mar", "model_name": "huge", "response_timeout": huge},
        )
        assert said(first, 200) == 'Model "huge" Version: 1.0 registered with 1 initial workers'
        second = http.post(
            "/models",
            params={
                "url": "shout-v2.tar.gz",
                "model_name": "huge",
                "response_timeout": huge,
                "batch_size": huge,
                "initial_workers": huge,
            },
        )
        assert "Version: 2.0 registered" in said(second, 200)
        described = http.get("/models/huge/all").json()
        assert [(d["responseTimeout"], d["batchSize"], d["minWorkers"]) for d in described] == [
            (0, 1, 1),
            (0, 1, 1),
        ]
        scaled = http.put("/models/huge", params={"min_worker": huge, "synchronous": "true"})
        assert said(scaled, 200) == "Workers scaled to 1 for model: huge"
        assert said(http.delete("/models/huge/2.0"), 200) == 'Model "huge" unregistered'
        assert said(http.delete("/models/huge"), 200) == 'Model "huge" unregistered'
