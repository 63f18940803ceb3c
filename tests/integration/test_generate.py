"""Triton's generate extension on a real stack: ``/generate`` and ``/generate_stream`` for
a text model and a numeric one with a variable dimension; bad requests say what is wrong."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from sluice.scheduler.executor.redis_server import RedisServer
from tests.support.model_files import python_config, tensor, write_model
from tests.support.stack import Stack

SHOUTER = """
    import numpy as np


    class Model:
        def execute(self, inputs):
            text = inputs["text_input"]
            loud = np.array([[t.upper() for t in row] for row in text], dtype=np.object_)
            return {"text_output": loud}
"""

SUMMER = """
    import numpy as np


    class Model:
        def execute(self, inputs):
            x = inputs["x"]
            return {"total": np.array([x.sum()], dtype=np.float32), "doubled": x * 2}
"""


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer) -> Iterator[Stack]:
    root: Path = tmp_path_factory.mktemp("generate")
    text = python_config(
        [tensor("text_input", "TYPE_STRING", "1")], [tensor("text_output", "TYPE_STRING", "1")]
    )
    write_model(root, "shouter", text, {"1/model.py": SHOUTER})
    numbers = python_config(
        [tensor("x", "TYPE_FP32", "-1")],
        [tensor("total", "TYPE_FP32", "1"), tensor("doubled", "TYPE_FP32", "-1")],
        max_batch_size=0,
    )
    write_model(root, "summer", numbers, {"1/model.py": SUMMER})
    stack = Stack(root, redis_server.url)
    stack.start()
    yield stack
    stack.stop()


def test_generate_answers_with_each_output_by_name(stack: Stack) -> None:
    answer = httpx.post(
        f"{stack.url}/v2/models/shouter/generate",
        json={"text_input": "client input", "parameters": {"temperature": 0}},
        timeout=30,
    )
    assert answer.status_code == 200, answer.text
    assert answer.json() == {
        "model_name": "shouter",
        "model_version": "1",
        "text_output": "CLIENT INPUT",
    }
    numbers = httpx.post(
        f"{stack.url}/v2/models/summer/versions/1/generate", json={"x": [1, 2, 3.5]}, timeout=30
    )
    assert numbers.status_code == 200, numbers.text
    assert numbers.json()["total"] == 6.5
    assert numbers.json()["doubled"] == [2, 4, 7]


def test_generate_stream_sends_the_answer_as_a_server_sent_event(stack: Stack) -> None:
    answer = httpx.post(
        f"{stack.url}/v2/models/shouter/generate_stream", json={"text_input": "hi"}, timeout=30
    )
    assert answer.status_code == 200, answer.text
    assert answer.headers["content-type"] == "text/event-stream; charset=utf-8"
    assert answer.text.startswith("data: ") and answer.text.endswith("\n\n")
    assert '"text_output":"HI"' in answer.text


@pytest.mark.parametrize(
    ("model", "body", "status", "fragment"),
    [
        ("shouter", {"prompt": "x"}, 400, "has no value for input 'text_input'"),
        ("shouter", {"text_input": "x", "parameters": 3}, 400, "'parameters' must be an object"),
        ("nothing", {"text_input": "x"}, 404, "nothing"),
    ],
)
def test_bad_generate_requests_say_what_is_wrong(
    stack: Stack, model: str, body: dict[str, object], status: int, fragment: str
) -> None:
    answer = httpx.post(f"{stack.url}/v2/models/{model}/generate", json=body, timeout=30)
    assert answer.status_code == status, answer.text
    assert fragment in answer.json()["error"]
