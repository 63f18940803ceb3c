"""A handler that fails one entry of a batch, through a real stack: TorchServe hands a
handler one entry per row, so a KServe v2 request of several rows is several entries of the
batch. The request a failed row belongs to fails with that row's error, and every other
request batched with it, predictions and explanations alike, gets its own answer."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from sluice.scheduler.executor.redis_server import RedisServer, free_port
from tests.support.stack import Stack
from tests.support.torchserve_archives import import_with_models, make_archive

HANDLER = '''
def handle(data, context):
    """Upper-cases text; a batch holding "bad" (a prediction) or "worse" (an explanation)
    fails whole, as a handler that cannot answer one entry does. Each call's kind and size
    go to the log, so the test knows what was batched together."""
    if data is None:
        return None
    explain = context.get_request_header(0, "explain") == "True"
    texts = [row["body"] for row in data]
    with open(LOG, "a") as log:
        log.write(f"{explain} {len(texts)}\\n")
    if ("worse" if explain else "bad") in texts:
        raise ValueError("the row " + ("worse" if explain else "bad"))
    return [("why " if explain else "") + text.upper() for text in texts]
'''

MODEL = "rows"
BATCH = 8
"""The rows the test's requests hold together: the batch goes as soon as it is full."""


@pytest.fixture(scope="module")
def inference_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def calls_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("ts-row-failures-log") / "calls.txt"


@pytest.fixture(scope="module")
def stack(
    tmp_path_factory: pytest.TempPathFactory,
    redis_server: RedisServer,
    inference_port: int,
    calls_log: Path,
) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("ts-row-failures")
    make_archive(tmp / "store", MODEL, f"LOG = {str(calls_log)!r}\n" + HANDLER)
    models = {MODEL: {"1.0": {"batchSize": BATCH, "maxBatchDelay": 5000}}}
    repository = import_with_models(tmp / "store", models)
    with (repository / MODEL / "config.pbtxt").open("a") as config:  # (the whole window)
        config.write('parameters { key: "adaptive_batching" value { string_value: "false" } }\n')
    stack = Stack(
        repository, redis_server.url, args=["--torchserve-ports", f"{inference_port},0,0"]
    )
    stack.start()
    yield stack
    stack.stop()


def _rows(texts: list[str]) -> dict[str, Any]:
    """A KServe v2 request of one row per text."""
    shape = [len(texts), 1]
    return {
        "inputs": [
            {"name": "body", "shape": shape, "datatype": "BYTES", "data": texts},
            {
                "name": "content_type",
                "shape": shape,
                "datatype": "BYTES",
                "data": ["text/plain"] * len(texts),
            },
        ],
        "outputs": [{"name": "response"}],
    }


def test_a_failed_row_fails_its_own_request_and_the_batch_s_others_are_answered(
    stack: Stack, inference_port: int, calls_log: Path
) -> None:
    base = f"http://127.0.0.1:{inference_port}"
    plain = {"content-type": "text/plain"}
    calls: dict[str, tuple[str, dict[str, Any]]] = {
        "prediction": (f"/predictions/{MODEL}", {"content": "fine", "headers": plain}),
        "failing rows": (f"/v2/models/{MODEL}/infer", {"json": _rows(["one", "bad", "three"])}),
        "explanation": (f"/explanations/{MODEL}", {"content": "this", "headers": plain}),
        "failing explanation": (f"/explanations/{MODEL}", {"content": "worse", "headers": plain}),
        "rows": (f"/v2/models/{MODEL}/infer", {"json": _rows(["x", "y"])}),
    }
    together = threading.Barrier(len(calls))

    def call(name: str) -> tuple[str, httpx.Response]:
        path, request = calls[name]
        with httpx.Client(timeout=60) as client:
            together.wait()
            return name, client.post(base + path, **request)

    with ThreadPoolExecutor(len(calls)) as pool:
        answers = dict(pool.map(call, calls))
    # (the predictions' rows, 1 + 3 + 2, went to the handler as one batch)
    assert "False 6" in calls_log.read_text().splitlines()

    for name in ("prediction", "explanation"):
        assert answers[name].status_code == 200, (name, answers[name].text)
    assert answers["prediction"].text == "FINE"
    assert answers["explanation"].text == "why THIS"
    assert answers["rows"].status_code == 200, answers["rows"].text
    (response,) = answers["rows"].json()["outputs"]
    assert (response["shape"], response["data"]) == ([2, 1], ["X", "Y"])

    # TorchServe's answer to a handler that raised: 503, "Prediction failed".
    failed = answers["failing rows"]
    assert failed.status_code == 503, failed.text
    assert failed.json() == {"error": "Prediction failed"}
    refused = answers["failing explanation"]
    assert refused.status_code == 503, refused.text
    assert refused.json() == {
        "code": 503,
        "type": "InternalServerException",
        "message": "Prediction failed",
    }
