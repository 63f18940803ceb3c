"""TorchServe's answers, status and body, through a real stack: the status a handler sets
for a request (``context.set_response_status``), TorchServe's status and words for a
handler that fails (503 ``Prediction failed``, a ``PredictionException``'s code and
message), its exception names in error bodies, and versions as TorchServe reads them (a
version that is no number is not found; the routes without a version read none from the
query)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from sluice.scheduler.executor.redis_server import RedisServer, free_port
from tests.support.stack import Stack
from tests.support.torchserve_archives import import_with_models, make_archive

HANDLER = '''
from ts.utils.util import PredictionException


def handle(data, context):
    """Text in, capitals out; "teapot" is answered 418 with a body of its own, "refuse"
    with a PredictionException, "boom" by raising."""
    if data is None:
        return None
    answers = []
    for index, row in enumerate(data):
        text = row["body"]
        if text == "refuse":
            raise PredictionException("no such thing", 422)
        if text == "boom":
            raise RuntimeError("a handler's own trouble")
        if text == "teapot":
            context.set_response_status(418, "I'm a teapot", index)
            context.set_response_content_type(index, "application/json")
            answers.append({"short": "stout"})
        else:
            answers.append(text.upper())
    return answers
'''

MODEL = "kettle"
PLAIN = {"content-type": "text/plain"}


@pytest.fixture(scope="module")
def inference_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def stack(
    tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer, inference_port: int
) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("ts-statuses")
    make_archive(tmp / "store", MODEL, HANDLER)
    repository = import_with_models(tmp / "store", {MODEL: {"1.0": {}}})
    stack = Stack(
        repository, redis_server.url, args=["--torchserve-ports", f"{inference_port},0,0"]
    )
    stack.start()
    yield stack
    stack.stop()


@pytest.fixture
def http(inference_port: int) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=f"http://127.0.0.1:{inference_port}", timeout=60) as client:
        yield client


@pytest.mark.parametrize(
    "path",
    [
        f"/predictions/{MODEL}",
        f"/predictions/{MODEL}/1.0",
        f"/explanations/{MODEL}",
        f"/v1/models/{MODEL}:predict",
    ],
)
def test_a_status_the_handler_sets_answers_its_request(
    stack: Stack, http: httpx.Client, path: str
) -> None:
    teapot = http.post(path, content="teapot", headers=PLAIN)
    assert teapot.status_code == 418, teapot.text
    assert teapot.headers["content-type"] == "application/json"
    assert teapot.json() == {"short": "stout"}
    fine = http.post(path, content="fine", headers=PLAIN)
    assert (fine.status_code, fine.text) == (200, "FINE")


def test_a_kserve_v2_request_carries_the_handler_s_status_as_a_parameter(
    stack: Stack, http: httpx.Client
) -> None:
    """Sluice's KServe v2 answer is tensors: the status goes with it as a parameter."""
    document: dict[str, Any] = {
        "inputs": [
            {"name": "body", "shape": [1, 1], "datatype": "BYTES", "data": ["teapot"]},
            {"name": "content_type", "shape": [1, 1], "datatype": "BYTES", "data": ["text/plain"]},
        ],
        "outputs": [{"name": "response"}],
    }
    answer = http.post(f"/v2/models/{MODEL}/infer", json=document)
    assert answer.status_code == 200, answer.text
    assert answer.json()["parameters"]["torchserve_status"] == 418


@pytest.mark.parametrize(
    ("text", "code", "message"),
    [("refuse", 422, "no such thing"), ("boom", 503, "Prediction failed")],
)
def test_a_handler_that_fails_is_answered_as_torchserve_answers(
    stack: Stack, http: httpx.Client, text: str, code: int, message: str
) -> None:
    for path in (f"/predictions/{MODEL}", f"/v1/models/{MODEL}:predict"):
        failed = http.post(path, content=text, headers=PLAIN)
        assert failed.status_code == code, failed.text
        assert failed.json() == {
            "code": code,
            "type": "InternalServerException",
            "message": message,
        }


def test_a_version_that_is_no_number_is_not_found(stack: Stack, http: httpx.Client) -> None:
    missing = {
        "code": 404,
        "type": "ModelVersionNotFoundException",
        "message": f"Model version: abc does not exist for model: {MODEL}",
    }
    for answer in (
        http.post(f"/predictions/{MODEL}/abc", content="x", headers=PLAIN),
        http.post(f"/explanations/{MODEL}/abc", content="x", headers=PLAIN),
        httpx.get(f"{stack.url}/models/{MODEL}/abc", timeout=30),
    ):
        assert (answer.status_code, answer.json()) == (404, missing), answer.url
    unknown = http.post("/predictions/nothing", content="x", headers=PLAIN)
    assert unknown.json() == {
        "code": 404,
        "type": "ModelNotFoundException",
        "message": "Model not found: nothing",
    }


def test_the_routes_without_a_version_read_none_from_the_query(
    stack: Stack, http: httpx.Client
) -> None:
    answer = http.post(f"/predictions/{MODEL}", params={"version": "7"}, content="x", headers=PLAIN)
    assert (answer.status_code, answer.text) == (200, "X")
    described = httpx.get(f"{stack.url}/models/{MODEL}", params={"version": "7"}, timeout=30)
    assert described.status_code == 200, described.text
    assert [row["modelVersion"] for row in described.json()] == ["1.0"]
    document = http.get("/api-description").json()
    for path in ("/predictions/{model}", "/explanations/{model}"):
        parameters = document["paths"][path]["post"].get("parameters", [])
        assert "version" not in {p["name"] for p in parameters}, path
