"""TorchServe's explanations API through a real stack: ``POST /explanations/{model}
[/{version}]`` and KServe v1's ``/v1/models/{model}:explain`` run the archive's
``BaseHandler`` with the request marked (the ``explain`` header its context answers), so
``handle`` calls ``explain_handle`` instead of ``inference``; on TorchServe's inference port
and on Sluice's own, with TorchServe's 404s for a model or a version it does not serve, and
counted in ``ts_inference_requests_total`` as predictions are."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from sluice.core.torchserve.explanations import EXPLAIN
from sluice.scheduler.executor.redis_server import RedisServer, free_port
from tests.support.stack import Stack
from tests.support.torchserve_archives import import_with_models, make_archive

EXPLAINER = '''
from ts.torch_handler.base_handler import BaseHandler


class Explained(BaseHandler):
    """Text in: its length as the prediction, its words as the explanation."""

    def initialize(self, context):
        self.context = context
        self.initialized = True

    def preprocess(self, data):
        texts = []
        for row in data:
            body = row.get("data") or row.get("body")
            texts.append(body.decode() if isinstance(body, (bytes, bytearray)) else str(body))
        return texts

    def inference(self, data, *args, **kwargs):
        return [len(text) for text in data]

    def postprocess(self, data):
        header = self.context.get_request_header(0, "explain")
        return [{"prediction": length, "explain": header} for length in data]

    def explain_handle(self, data_preprocess, raw_data):
        header = self.context.get_request_header(0, "explain")
        return [{"explanation": text.split()[:3], "explain": header} for text in data_preprocess]
'''

MODEL = "explained"


@pytest.fixture(scope="module")
def inference_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def stack(
    tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer, inference_port: int
) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("ts-explanations")
    make_archive(tmp / "store", MODEL, EXPLAINER)
    models = {MODEL: {"1.0": {"batchSize": 8, "maxBatchDelay": 50}}}
    repository = import_with_models(tmp / "store", models)
    stack = Stack(
        repository,
        redis_server.url,
        env={"SLUICE_TORCHSERVE_METRICS": "true"},
        args=["--torchserve-ports", f"{inference_port},0,0"],
    )
    stack.start()
    yield stack
    stack.stop()


def _prediction(text: str) -> dict[str, object]:
    return {"prediction": len(text), "explain": "False"}


def _explanation(text: str) -> dict[str, object]:
    return {"explanation": text.split()[:3], "explain": "True"}


def test_explanations_run_explain_handle_and_predictions_inference(
    stack: Stack, inference_port: int
) -> None:
    text = "why is this so"
    plain = {"content-type": "text/plain"}
    with httpx.Client(timeout=60) as http:
        for base in (f"http://127.0.0.1:{inference_port}", stack.url):
            for path in (f"/predictions/{MODEL}", f"/predictions/{MODEL}/1.0"):
                answer = http.post(base + path, content=text, headers=plain)
                assert answer.status_code == 200, (path, answer.text)
                assert answer.json() == _prediction(text)
            for path in (
                f"/explanations/{MODEL}",
                f"/explanations/{MODEL}/1.0",
                f"/v1/models/{MODEL}:explain",
            ):
                answer = http.post(base + path, content=text, headers=plain)
                assert answer.status_code == 200, (path, answer.text)
                assert answer.headers["content-type"].startswith("application/json")
                assert answer.json() == _explanation(text)
            predicted = http.post(base + f"/v1/models/{MODEL}:predict", content=text)
            assert predicted.status_code == 200, predicted.text
            assert predicted.json() == _prediction(text)
        # (a client cannot mark a call for explanation itself: the name is reserved)
        document = {
            "inputs": [
                {"name": "body", "shape": [1, 1], "datatype": "BYTES", "data": [text]},
                {"name": "content_type", "shape": [1, 1], "datatype": "BYTES", "data": ["x"]},
            ],
            "parameters": {EXPLAIN: True},
        }
        refused = http.post(f"{stack.url}/v2/models/{MODEL}/infer", json=document)
        assert refused.status_code == 400, refused.text
        # An explanation's body has the inference routes' limit, not the control routes'.
        big = "word " * (300 * 1024)  # (1.5 MiB, past SLUICE_MAX_CONTROL_BODY_BYTES)
        answer = http.post(f"{stack.url}/explanations/{MODEL}", content=big, headers=plain)
        assert answer.status_code == 200, answer.text
        assert answer.json() == _explanation(big)


def test_predictions_and_explanations_at_once_each_get_their_own_answer(stack: Stack) -> None:
    """Calls of both kinds batched together: each is answered as its route asks (TorchServe's
    handler reads the first request's mark for a whole batch)."""
    texts = [f"text number {i} here" for i in range(24)]

    def one(index: int) -> tuple[int, dict[str, object]]:
        route = "explanations" if index % 2 else "predictions"
        with httpx.Client(timeout=60) as client:
            answer = client.post(f"{stack.url}/{route}/{MODEL}", content=texts[index])
            assert answer.status_code == 200, answer.text
            return index, answer.json()

    with ThreadPoolExecutor(12) as pool:
        answers = dict(pool.map(one, range(len(texts))))
    for index, text in enumerate(texts):
        expected = _explanation(text) if index % 2 else _prediction(text)
        assert answers[index] == expected, index


def test_unknown_models_and_versions_get_torchserve_s_404(
    stack: Stack, inference_port: int
) -> None:
    with httpx.Client(timeout=60) as http:
        for base in (f"http://127.0.0.1:{inference_port}", stack.url):
            for path, message in (
                ("/explanations/missing", "Model not found: missing"),
                ("/explanations/missing/1.0", "Model not found: missing"),
                ("/predictions/missing", "Model not found: missing"),
                ("/v1/models/missing:explain", "Model not found: missing"),
                ("/v1/models/missing:predict", "Model not found: missing"),
                (
                    f"/explanations/{MODEL}/9.0",
                    f"Model version: 9.0 does not exist for model: {MODEL}",
                ),
                (
                    f"/predictions/{MODEL}/2",
                    f"Model version: 2 does not exist for model: {MODEL}",
                ),
                (  # (TorchServe compares versions as text: 1 is not 1.0)
                    f"/explanations/{MODEL}/1",
                    f"Model version: 1 does not exist for model: {MODEL}",
                ),
            ):
                answer = http.post(base + path, content=b"x")
                assert answer.status_code == 404, (base, path, answer.text)
                body = answer.json()
                assert set(body) == {"code", "type", "message"}
                assert (body["code"], body["message"]) == (404, message), path
        described = http.options(f"http://127.0.0.1:{inference_port}/explanations/{MODEL}")
        assert described.status_code == 200, described.text
        assert f"/explanations/{MODEL}" in described.json()["paths"]
        assert http.options(f"{stack.url}/explanations/missing").status_code == 404


def test_explanations_count_in_torchserve_s_request_total(stack: Stack) -> None:
    def total() -> float:
        for line in httpx.get(f"{stack.url}/metrics", timeout=30).text.splitlines():
            if line.startswith(f'ts_inference_requests_total{{model_name="{MODEL}"'):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    before = total()
    for _ in range(3):
        answer = httpx.post(f"{stack.url}/explanations/{MODEL}", content=b"a b", timeout=60)
        assert answer.status_code == 200, answer.text
    deadline = time.monotonic() + 10  # (the workers' counts reach Redis within moments)
    while total() < before + 3 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert total() >= before + 3
