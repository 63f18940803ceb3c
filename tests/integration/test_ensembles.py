"""Triton ensembles through a real stack: a three-step pipeline (Python preprocessing ->
ONNX model -> Python postprocessing) and a graph with two parallel branches joined, each
equal to the same computation composed in-process, over plain HTTP and tritonclient; a
failing step names itself with the step's status; a step whose model answers another
shape than it declares fails the next step with a 400; statistics of the ensemble and of
its composing models; an ensemble whose composing model is missing does not load."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.http as httpclient
from onnx import TensorProto, helper, numpy_helper

from sluice.scheduler.executor.redis_server import RedisServer
from tests.support.onnx_models import save
from tests.support.stack import Stack

WEIGHTS = np.array([[1.0, -1.0], [0.5, 0.25], [-2.0, 1.0], [0.0, 3.0]], dtype=np.float32)

PRE = """
import numpy as np


class Model:
    def execute(self, inputs):
        text = inputs["TEXT"].reshape(-1)
        if any(value == b"boom" for value in text):
            raise ValueError("cannot featurize 'boom'")
        rows = [[len(v), v.count(b"a"), v.count(b" "), 1.0] for v in text]
        return {"FEATURES": np.array(rows, dtype=np.float32)}
"""

POST = """
import numpy as np


class Model:
    def execute(self, inputs):
        logits = inputs["LOGITS"]
        labels = np.array([b"left" if row[0] >= row[1] else b"right" for row in logits],
                          dtype=object).reshape(-1, 1)
        return {"LABEL": labels, "MARGIN": np.abs(logits[:, :1] - logits[:, 1:])}
"""

UNARY = """
import numpy as np


class Model:
    def execute(self, inputs):
        x = inputs["X"]
        return {{"Y": ({expression}).astype(np.float32)}}
"""

ADD = """
class Model:
    def execute(self, inputs):
        return {"SUM": inputs["A"] + inputs["B"]}
"""


def _python(root: Path, name: str, source: str, inputs: str, outputs: str) -> None:
    (root / name / "1").mkdir(parents=True)
    (root / name / "1" / "model.py").write_text(source)
    (root / name / "config.pbtxt").write_text(
        f'name: "{name}"\nbackend: "python"\nmax_batch_size: 8\n'
        f"input [ {inputs} ]\noutput [ {outputs} ]\n"
    )


def _fp32(name: str, width: int) -> str:
    return f'{{ name: "{name}" data_type: TYPE_FP32 dims: [ {width} ] }}'


def _text(name: str) -> str:
    return f'{{ name: "{name}" data_type: TYPE_STRING dims: [ 1 ] }}'


def _linear(root: Path) -> None:
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["X", "W"], ["Y"])],
        "linear",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, [None, 4])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [None, 2])],
        initializer=[numpy_helper.from_array(WEIGHTS, "W")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    save(model, root / "linear" / "1" / "model.onnx")
    (root / "linear" / "config.pbtxt").write_text(
        'name: "linear"\nplatform: "onnxruntime_onnx"\nmax_batch_size: 8\n'
        f"input [ {_fp32('X', 4)} ]\noutput [ {_fp32('Y', 2)} ]\n"
    )


def _step(model: str, inputs: dict[str, str], outputs: dict[str, str]) -> str:
    maps = [f'input_map {{ key: "{k}" value: "{v}" }}' for k, v in inputs.items()]
    maps += [f'output_map {{ key: "{k}" value: "{v}" }}' for k, v in outputs.items()]
    return f'{{ model_name: "{model}" model_version: -1 {" ".join(maps)} }}'


def _ensemble(root: Path, name: str, inputs: str, outputs: str, *steps: str) -> None:
    (root / name / "1").mkdir(parents=True)
    (root / name / "config.pbtxt").write_text(
        f'name: "{name}"\nplatform: "ensemble"\nmax_batch_size: 8\n'
        f"input [ {inputs} ]\noutput [ {outputs} ]\n"
        f"ensemble_scheduling {{ step [ {', '.join(steps)} ] }}\n"
    )


def _build(root: Path) -> None:
    _python(root, "pre", PRE, _text("TEXT"), _fp32("FEATURES", 4))
    _linear(root)
    _python(
        root,
        "post",
        POST,
        _fp32("LOGITS", 2),
        f"{_text('LABEL')}, {_fp32('MARGIN', 1)}",
    )
    _ensemble(
        root,
        "pipeline",
        _text("SENTENCE"),
        f"{_text('DECISION')}, {_fp32('CONFIDENCE', 1)}",
        _step("pre", {"TEXT": "SENTENCE"}, {"FEATURES": "features"}),
        _step("linear", {"X": "features"}, {"Y": "logits"}),
        _step("post", {"LOGITS": "logits"}, {"LABEL": "DECISION", "MARGIN": "CONFIDENCE"}),
    )
    _python(root, "double", UNARY.format(expression="2 * x"), _fp32("X", 4), _fp32("Y", 4))
    _python(root, "square", UNARY.format(expression="x * x"), _fp32("X", 4), _fp32("Y", 4))
    _python(root, "add", ADD, f"{_fp32('A', 4)}, {_fp32('B', 4)}", _fp32("SUM", 4))
    _ensemble(
        root,
        "diamond",
        _fp32("IN", 4),
        _fp32("OUT", 4),
        _step("add", {"A": "doubled", "B": "squared"}, {"SUM": "OUT"}),
        _step("double", {"X": "IN"}, {"Y": "doubled"}),
        _step("square", {"X": "IN"}, {"Y": "squared"}),
    )
    # A step whose model answers more than it declares (8 columns for its [4]):
    _python(root, "spill", UNARY.format(expression="np.tile(x, 2)"), _fp32("X", 4), _fp32("Y", 4))
    _ensemble(
        root,
        "spilling",
        _fp32("IN", 4),
        _fp32("OUT", 2),
        _step("spill", {"X": "IN"}, {"Y": "wide"}),
        _step("linear", {"X": "wide"}, {"Y": "OUT"}),
    )
    _ensemble(
        root,
        "orphan",
        _fp32("IN", 4),
        _fp32("OUT", 4),
        _step("ghost", {"X": "IN"}, {"Y": "OUT"}),
    )


def _expected_pipeline(texts: list[bytes]) -> tuple[list[bytes], np.ndarray]:
    features = np.array(
        [[len(t), t.count(b"a"), t.count(b" "), 1.0] for t in texts], dtype=np.float32
    )
    logits = features @ WEIGHTS
    labels = [b"left" if row[0] >= row[1] else b"right" for row in logits]
    return labels, np.abs(logits[:, :1] - logits[:, 1:])


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("ensembles")
    _build(root)
    stack = Stack(root, redis_server.url)
    stack.start()
    yield stack
    stack.stop()


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer()
    server.start()
    yield server
    server.stop()


def _stats(http: httpx.Client, model: str) -> dict[str, int]:
    stats = http.get(f"/v2/models/{model}/stats").json()["model_stats"][0]
    inference = stats["inference_stats"]
    return {
        "success": inference["success"]["count"],
        "fail": inference["fail"]["count"],
        "count": stats["inference_count"],
    }


def test_pipeline_over_http_equals_the_composed_computation(stack: Stack) -> None:
    texts = [b"a banana", b"xyz", b"aaaa aaaa a", b""]
    labels, margins = _expected_pipeline(texts)
    body = {
        "id": "pipe-1",
        "inputs": [
            {
                "name": "SENTENCE",
                "shape": [len(texts), 1],
                "datatype": "BYTES",
                "data": [t.decode() for t in texts],
            }
        ],
    }
    with httpx.Client(base_url=stack.url, timeout=30) as http:
        response = http.post("/v2/models/pipeline/infer", json=body)
        assert response.status_code == 200, response.text
        answer = response.json()
    assert answer["model_name"] == "pipeline" and answer["id"] == "pipe-1"
    outputs = {o["name"]: o for o in answer["outputs"]}
    assert [v.encode() for v in outputs["DECISION"]["data"]] == labels
    assert outputs["CONFIDENCE"]["shape"] == [len(texts), 1]
    np.testing.assert_allclose(outputs["CONFIDENCE"]["data"], margins.reshape(-1), rtol=1e-6)


def test_diamond_with_tritonclient_runs_parallel_branches(stack: Stack) -> None:
    client = httpclient.InferenceServerClient(stack.address)
    assert client.is_model_ready("diamond")
    rng = np.random.default_rng(0)
    for rows in (1, 3, 8):
        x = rng.standard_normal((rows, 4)).astype(np.float32)
        tensor = httpclient.InferInput("IN", list(x.shape), "FP32")
        tensor.set_data_from_numpy(x, binary_data=True)
        result = client.infer("diamond", [tensor])
        np.testing.assert_allclose(result.as_numpy("OUT"), 2 * x + x * x, rtol=1e-6)


def test_concurrent_requests_all_answer_right(stack: Stack) -> None:
    """Many requests at once: the ensemble instance keeps them all in flight."""
    inputs = [np.full((1, 4), seed, dtype=np.float32) for seed in range(32)]

    def call(x: np.ndarray) -> list[float]:
        body = {
            "inputs": [
                {"name": "IN", "shape": [1, 4], "datatype": "FP32", "data": x.ravel().tolist()}
            ]
        }
        with httpx.Client(base_url=stack.url, timeout=30) as http:
            response = http.post("/v2/models/diamond/infer", json=body)
        assert response.status_code == 200, response.text
        data: list[float] = response.json()["outputs"][0]["data"]
        return data

    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(call, inputs))
    for x, answer in zip(inputs, answers, strict=True):
        np.testing.assert_allclose(answer, (2 * x + x * x).ravel(), rtol=1e-6)


def test_failing_step_names_the_step_with_its_status(stack: Stack) -> None:
    body = {
        "inputs": [{"name": "SENTENCE", "shape": [1, 1], "datatype": "BYTES", "data": ["boom"]}]
    }
    with httpx.Client(base_url=stack.url, timeout=30) as http:
        response = http.post("/v2/models/pipeline/infer", json=body)
    assert response.status_code == 500
    error = response.json()["error"]
    assert error.startswith("in ensemble 'pipeline', step 0 (model 'pre'): ")
    assert "cannot featurize 'boom'" in error


def test_a_step_answering_another_shape_than_declared_fails_the_next_step_clearly(
    stack: Stack,
) -> None:
    """The next step's model checks the shape of what it is given, as a client's request
    is checked (before: its backend failed on it, a 500 with onnxruntime's text)."""
    body = {"inputs": [{"name": "IN", "shape": [1, 4], "datatype": "FP32", "data": [1] * 4}]}
    with httpx.Client(base_url=stack.url, timeout=30) as http:
        response = http.post("/v2/models/spilling/infer", json=body)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error.startswith("in ensemble 'spilling', step 1 (model 'linear'): "), error
        assert (
            "unexpected shape for input 'X' for model 'linear'. Expected [-1,4], got [1,8]"
        ) in error
        fine = {"inputs": [{"name": "X", "shape": [1, 4], "datatype": "FP32", "data": [1] * 4}]}
        assert http.post("/v2/models/linear/infer", json=fine).status_code == 200


def test_stats_count_the_ensemble_and_each_step(stack: Stack) -> None:
    with httpx.Client(base_url=stack.url, timeout=30) as http:
        before = {m: _stats(http, m) for m in ("pipeline", "pre", "linear", "post")}
        body = {
            "inputs": [
                {"name": "SENTENCE", "shape": [2, 1], "datatype": "BYTES", "data": ["a", "b"]}
            ]
        }
        for _ in range(3):
            assert http.post("/v2/models/pipeline/infer", json=body).status_code == 200
        failing = {
            "inputs": [{"name": "SENTENCE", "shape": [1, 1], "datatype": "BYTES", "data": ["boom"]}]
        }
        assert http.post("/v2/models/pipeline/infer", json=failing).status_code == 500
        after = {m: _stats(http, m) for m in ("pipeline", "pre", "linear", "post")}

    def delta(model: str, field: str) -> int:
        return after[model][field] - before[model][field]

    assert (delta("pipeline", "success"), delta("pipeline", "fail")) == (3, 1)
    assert delta("pipeline", "count") == 6
    assert (delta("pre", "success"), delta("pre", "fail")) == (3, 1)
    for model in ("linear", "post"):
        assert (delta(model, "success"), delta(model, "fail"), delta(model, "count")) == (3, 0, 6)


def test_missing_composing_model_is_a_load_error(stack: Stack) -> None:
    with httpx.Client(base_url=stack.url, timeout=30) as http:
        index = {row["name"]: row for row in http.post("/v2/repository/index").json()}
        assert index["orphan"]["state"] == "UNAVAILABLE"
        assert (
            "step 0 (model 'ghost'): model 'ghost' is not in the repository"
            in (index["orphan"]["reason"])
        )
        assert http.get("/v2/models/orphan/ready").status_code in (400, 503)
        body = {"inputs": [{"name": "IN", "shape": [1, 4], "datatype": "FP32", "data": [1] * 4}]}
        response = http.post("/v2/models/orphan/infer", json=body)
        assert response.status_code == 404  # (Triton's: it has no available versions)
        assert "ghost" in response.json()["error"]
        assert http.get("/v2/models/pipeline/ready").status_code == 200
