"""A TorchServe user's day one, end to end on TorchServe's own ports: ``sluice up
--torchserve`` serves the management API on 8081, the inference API on 8080 and the
metrics on 8082; archives with the names of TorchServe's examples (``noop``, ``mnist``),
made by the real ``torch-model-archiver``, are registered, scaled, described, called,
counted and unregistered as TorchServe's own API collections do it."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from sluice.scheduler.executor.redis_server import RedisServer
from tests.support.model_files import save_torchscript
from tests.support.stack import Stack
from tests.support.torchserve_archives import make_archive, store_stack

INFERENCE, MANAGEMENT, METRICS = 8080, 8081, 8082

NOOP_HANDLER = """
def handle(data, context):
    return None if data is None else ["OK" for _ in data]
"""

MNIST_HANDLER = '''
import json

import torch


class Digits:
    """A JSON list of 784 pixels in, the most likely digit out."""

    def initialize(self, context):
        folder = context.system_properties["model_dir"]
        self.model = torch.jit.load(f"{folder}/mnist.pt")

    def handle(self, data, context):
        rows = []
        for request in data:
            body = request.get("data") or request.get("body")
            rows.append(json.loads(body) if isinstance(body, (bytes, bytearray)) else body)
        with torch.no_grad():
            scores = self.model(torch.tensor(rows, dtype=torch.float32))
        return [int(best) for best in scores.argmax(dim=1)]
'''


def _mnist(folder: Path) -> Path:
    """A stand-in for TorchServe's MNIST example: ten linear scores of 784 pixels, the score
    of digit d being the sum of pixels d*78 .. d*78+77."""
    weight = torch.zeros(10, 784)
    for digit in range(10):
        weight[digit, digit * 78 : digit * 78 + 78] = 1.0
    model = torch.nn.Linear(784, 10, bias=False)
    model.weight.data = weight
    return save_torchscript(model, (torch.zeros(1, 784),), folder / "mnist.pt")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("torchserve-day-one")
    store = tmp / "model_store"
    make_archive(store, "noop", NOOP_HANDLER)
    make_archive(store, "mnist", MNIST_HANDLER, extra=(_mnist(tmp),))
    stack = store_stack(tmp, redis_server.url, store, "--torchserve")
    stack.start()
    yield stack
    stack.stop()


def _on(port: int, path: str) -> str:
    return f"http://127.0.0.1:{port}{path}"


def _requests_2xx() -> float:
    text = httpx.get(_on(METRICS, "/metrics"), timeout=30).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.removesuffix("_total") == "Requests2XX":
                return sample.value
    raise AssertionError(f"no Requests2XX in {text}")


def test_register_scale_call_count_and_unregister_on_torchserve_s_ports(stack: Stack) -> None:
    with httpx.Client(timeout=120) as http:
        assert http.get(_on(MANAGEMENT, "/models")).json() == {"models": []}
        for name in ("noop", "mnist"):
            answer = http.post(
                _on(MANAGEMENT, "/models"),
                params={"url": f"{name}.mar", "initial_workers": 1, "synchronous": "true"},
            )
            assert answer.status_code == 200, answer.text
            assert answer.json() == {
                "status": f'Model "{name}" Version: 1.0 registered with 1 initial workers'
            }
        listed = http.get(_on(MANAGEMENT, "/models")).json()["models"]
        assert {m["modelName"] for m in listed} == {"noop", "mnist"}
        described = http.get(_on(MANAGEMENT, "/models/noop")).json()
        assert described[0]["modelName"] == "noop" and described[0]["modelVersion"] == "1.0"
        again = http.post(_on(MANAGEMENT, "/models"), params={"url": "noop.mar"})
        assert again.status_code == 409, again.text
        scaled = http.put(
            _on(MANAGEMENT, "/models/noop"), params={"min_worker": 2, "synchronous": "true"}
        )
        assert scaled.status_code == 200, scaled.text

        assert http.get(_on(INFERENCE, "/ping")).json() == {"status": "Healthy"}
        noop = http.post(_on(INFERENCE, "/predictions/noop"), content=b"anything")
        assert (noop.status_code, noop.text) == (200, "OK")
        pixels = [0.0] * 784
        pixels[3 * 78 : 3 * 78 + 78] = [1.0] * 78
        digit = http.post(_on(INFERENCE, "/predictions/mnist"), json=pixels)
        assert (digit.status_code, digit.text) == (200, "3")
        assert http.post(_on(INFERENCE, "/predictions/missing"), content=b"x").status_code == 404
        # Each API on its own port only, as TorchServe's.
        assert http.get(_on(INFERENCE, "/models")).status_code == 404
        assert http.post(_on(MANAGEMENT, "/predictions/noop"), content=b"x").status_code == 404

        deadline = time.monotonic() + 30
        while _requests_2xx() < 9 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert (
            _requests_2xx() >= 9
        )  # 2 lists, 2 registrations, a describe, a scale, a ping, 2 calls
        text = http.get(_on(METRICS, "/metrics")).text
        assert 'ts_inference_requests_total{model_name="mnist",' in text

        assert http.delete(_on(MANAGEMENT, "/models/noop")).status_code == 200
        assert http.get(_on(MANAGEMENT, "/models/noop")).status_code == 404
        assert http.post(_on(INFERENCE, "/predictions/noop"), content=b"x").status_code == 404
