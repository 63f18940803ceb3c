"""The examples of examples/more_backends (one per backend beyond ONNX, PyTorch and Python),
built as `make bootstrap` builds them, all served by one stack and each answering."""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import httpx
import numpy as np
import pytest
import tritonclient.http as httpclient

from sluice.scheduler.executor.redis_server import RedisServer
from tests.support.stack import Stack

ROOT = Path(__file__).resolve().parents[2]


def _builder() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "more_backends_build", ROOT / "examples" / "more_backends" / "build.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer) -> Iterator[Stack]:
    repository = tmp_path_factory.mktemp("more") / "repository"
    assert _builder().build_all(repository) == list(_builder().MODELS)
    stack = Stack(repository, redis_server.url)
    stack.start()
    yield stack
    stack.stop()


def _infer(stack: Stack, model: str, name: str, rows: np.ndarray, output: str) -> np.ndarray:
    with httpclient.InferenceServerClient(stack.address) as client:
        tensor = httpclient.InferInput(name, list(rows.shape), "FP32")
        tensor.set_data_from_numpy(rows)
        return client.infer(model, [tensor]).as_numpy(output)  # type: ignore[no-any-return]


def test_every_example_is_ready_and_answers(stack: Stack) -> None:
    # `sluice up` is ready once a gateway is; each model becomes ready once it has loaded,
    # which a busy machine (TensorFlow's import) can take a while for.
    wanted = dict.fromkeys(_builder().MODELS, "READY")
    deadline = time.monotonic() + 180
    while True:
        index = httpx.post(f"{stack.url}/v2/repository/index", json={}).json()
        states = {row["name"]: row["state"] for row in index}
        if states == wanted or "UNAVAILABLE" in states.values():
            break
        assert time.monotonic() < deadline, states
        time.sleep(0.5)
    assert states == wanted
    flower = np.array([[5.1, 3.5, 1.4, 0.2], [6.7, 3.0, 5.2, 2.3]], dtype=np.float32)
    for model in ("iris_xgboost", "iris_lightgbm", "iris_forest"):
        probabilities = _infer(stack, model, "input__0", flower, "output__0")
        assert probabilities.shape == (2, 3)
        np.testing.assert_allclose(probabilities.sum(axis=1), 1.0, rtol=1e-5)
        assert probabilities.argmax(axis=1).tolist() == [0, 2]  # setosa, virginica
    rows = np.ones((3, 16), dtype=np.float32)
    assert _infer(stack, "mlp_openvino", "input", rows, "output").shape == (3, 4)
    affine = _infer(stack, "affine_tensorflow", "x", flower, "y")
    weights = np.arange(8, dtype=np.float32).reshape(4, 2) / 10
    np.testing.assert_allclose(affine, flower @ weights + [0.5, -0.5], rtol=1e-5)
    shout = httpx.post(f"{stack.url}/predictions/shout", content="hello", timeout=30)
    assert shout.status_code == 200 and shout.text == "HELLO"
