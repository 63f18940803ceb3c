"""Every backend through a real stack: the same answers as in-process, instances, warm-up
failures, GPU models on a machine without one, and version policies."""

from __future__ import annotations

import importlib.util
import shutil
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from sluice.core.placement import Placement
from sluice.core.repository import read_model
from sluice.scheduler.executor.redis_server import RedisServer
from sluice.workers.backends import load_backend
from tests.support.model_files import python_config, tensor, write_model
from tests.support.stack import Stack

ROOT = Path(__file__).resolve().parents[2]
TORCH_MODELS = ("torchscript_mlp", "torch_export_mlp")
HAVE_TORCH = importlib.util.find_spec("torch") is not None

SLOW_ECHO = """
    import time


    class Model:
        def execute(self, inputs):
            time.sleep(0.02)
            return {"y": inputs["x"]}
"""

COLD = """
    class Model:
        def execute(self, inputs):
            raise RuntimeError("cold engine")
"""

VERSIONED = """
    class Model:
        def execute(self, inputs):
            return {{"y": inputs["x"] + {version}}}
"""

GUARDED = """
    import triton_python_backend_utils as pb_utils


    class TritonPythonModel:
        def execute(self, requests):
            responses = []
            for request in requests:
                x = pb_utils.get_input_tensor_by_name(request, "x").as_numpy()
                if (x < 0).any():
                    error = pb_utils.TritonError("negative input", pb_utils.TritonError.INVALID_ARG)
                    responses.append(pb_utils.InferenceResponse(error=error))
                else:
                    responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("y", x * 2)]))
            return responses
"""

FLOAT_IO = python_config([tensor("x", "TYPE_FP32", "2")], [tensor("y", "TYPE_FP32", "2")])


def _examples_builder() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "examples_build", ROOT / "model_repository/build.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build(root: Path) -> Path:
    builder = _examples_builder()
    builder.build_all(root, models=[*TORCH_MODELS, "text_stats", "triton_python_add_sub"])
    write_model(
        root,
        "pair",
        FLOAT_IO.replace("max_batch_size: 8", "max_batch_size: 1")
        + "instance_group [ { count: 2 kind: KIND_CPU } ]",
        {"1/model.py": SLOW_ECHO},
    )
    warmup = (
        'model_warmup [ { name: "first" batch_size: 2 inputs { key: "x" value: '
        "{ data_type: TYPE_FP32 dims: [ 2 ] zero_data: true } } } ]"
    )
    write_model(root, "cold", FLOAT_IO + warmup, {"1/model.py": COLD})
    batching = "dynamic_batching { max_queue_delay_microseconds: 100000 }"
    write_model(root, "guarded", FLOAT_IO + batching, {"1/model.py": GUARDED})
    plan_config = FLOAT_IO.replace('backend: "python"', 'platform: "tensorrt_plan"')
    plan_config += "instance_group [ { kind: KIND_GPU gpus: [ 0 ] } ]"
    write_model(root, "engine", plan_config, {"1/model.plan": b"\x00" * 64})
    if HAVE_TORCH:
        gpu_dir = root / "torch_gpu"
        shutil.copytree(root / "torchscript_mlp", gpu_dir)
        text = (gpu_dir / "config.pbtxt").read_text()
        text = text.replace('"torchscript_mlp"', '"torch_gpu"').replace("KIND_CPU", "KIND_GPU")
        (gpu_dir / "config.pbtxt").write_text(text)
    for name, policy in (
        ("versions_all", "all { }"),
        ("versions_latest", "latest { num_versions: 1 }"),
    ):
        files = {f"{v}/model.py": VERSIONED.format(version=100 * v) for v in (1, 2)}
        write_model(root, name, FLOAT_IO + f"version_policy: {{ {policy} }}", files)
    return root


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _build(tmp_path_factory.mktemp("backends"))


@pytest.fixture(scope="module")
def stack(repository: Path, redis_server: RedisServer) -> Iterator[Stack]:
    stack = Stack(repository, redis_server.url)
    stack.start()
    yield stack
    stack.stop()


@pytest.fixture
def client(stack: Stack) -> Iterator[httpclient.InferenceServerClient]:
    with httpclient.InferenceServerClient(stack.address, concurrency=8) as client:
        yield client


@pytest.fixture(scope="module")
def index(stack: Stack) -> dict[str, list[dict[str, str]]]:
    with httpx.Client(base_url=stack.url, timeout=10) as http:
        rows = http.post("/v2/repository/index").json()
    by_name: dict[str, list[dict[str, str]]] = {}
    for row in rows:
        by_name.setdefault(row["name"], []).append(row)
    return by_name


def _in_process(
    repository: Path, model: str, inputs: dict[str, np.ndarray]
) -> dict[str, np.ndarray]:
    entry = read_model(repository / model)
    assert entry.config is not None
    backend = load_backend(entry.config, entry.model_file(entry.versions[-1]), Placement())
    try:
        return backend.infer(inputs, [spec.name for spec in entry.config.outputs])
    finally:
        backend.close()


def _tensors(inputs: dict[str, np.ndarray], datatypes: dict[str, str]) -> list[Any]:
    tensors = []
    for name, array in inputs.items():
        tensor_in = httpclient.InferInput(name, list(array.shape), datatypes[name])
        tensor_in.set_data_from_numpy(array, binary_data=True)
        tensors.append(tensor_in)
    return tensors


def _infer(
    client: httpclient.InferenceServerClient,
    model: str,
    inputs: dict[str, np.ndarray],
    datatypes: dict[str, str],
    version: str = "",
) -> httpclient.InferResult:
    return client.infer(model, _tensors(inputs, datatypes), model_version=version)


def _infer_concurrently(
    client: httpclient.InferenceServerClient,
    model: str,
    batches: list[dict[str, np.ndarray]],
    datatypes: dict[str, str],
) -> list[httpclient.InferResult]:
    """All requests in flight at once (the client's gevent pool, not threads)."""
    pending = [client.async_infer(model, _tensors(b, datatypes)) for b in batches]
    return [request.get_result() for request in pending]


@pytest.mark.parametrize("model", TORCH_MODELS)
def test_torch_models_equal_in_process(
    client: httpclient.InferenceServerClient, repository: Path, model: str
) -> None:
    if not HAVE_TORCH:
        pytest.skip("torch is not installed (pip install sluice[torch])")
    input_name, output_name = (
        ("INPUT__0", "OUTPUT__0") if model == "torchscript_mlp" else ("input", "output")
    )
    inputs = {input_name: np.random.default_rng(5).standard_normal((6, 16)).astype(np.float32)}
    served = _infer(client, model, inputs, {input_name: "FP32"}).as_numpy(output_name)
    expected = _in_process(repository, model, inputs)[output_name]
    # The worker may use more threads than this process: sums run in another order.
    np.testing.assert_allclose(served, expected, rtol=1e-5, atol=1e-6)


def test_python_text_model_equals_in_process(
    client: httpclient.InferenceServerClient, repository: Path
) -> None:
    texts = np.array([["a b c"], ["naïve café"], [""]], dtype=np.object_)
    texts = np.vectorize(lambda s: s.encode(), otypes=[np.object_])(texts)
    result = _infer(client, "text_stats", {"TEXT": texts}, {"TEXT": "BYTES"})
    expected = _in_process(repository, "text_stats", {"TEXT": texts})
    for name in ("TOKENS", "CHARACTERS"):
        np.testing.assert_array_equal(result.as_numpy(name), expected[name])
    np.testing.assert_array_equal(result.as_numpy("TOKENS"), [[3], [2], [0]])


def test_triton_python_model_under_concurrent_requests(
    client: httpclient.InferenceServerClient, repository: Path
) -> None:
    rng = np.random.default_rng(9)
    batches = [
        {
            "INPUT0": rng.standard_normal((n, 4)).astype(np.float32),
            "INPUT1": rng.standard_normal((n, 4)).astype(np.float32),
        }
        for n in (1, 2, 1, 3, 1, 2, 1, 1)
    ]
    types = {"INPUT0": "FP32", "INPUT1": "FP32"}
    results = _infer_concurrently(client, "triton_python_add_sub", batches, types)
    for inputs, result in zip(batches, results, strict=True):
        expected = _in_process(repository, "triton_python_add_sub", inputs)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), expected["OUTPUT0"])
        np.testing.assert_array_equal(
            result.as_numpy("OUTPUT1"), inputs["INPUT0"] - inputs["INPUT1"]
        )


def test_two_instances_both_serve(client: httpclient.InferenceServerClient) -> None:
    x = np.ones((1, 2), dtype=np.float32)
    results = _infer_concurrently(client, "pair", [{"x": x}] * 40, {"x": "FP32"})
    assert all(np.array_equal(r.as_numpy("y"), x) for r in results)
    [stats] = client.get_inference_statistics("pair")["model_stats"]
    instances = stats["instance_stats"]
    assert len(instances) == 2, instances
    assert all(item["execution_count"] > 0 for item in instances), instances
    assert sum(item["execution_count"] for item in instances) == 40


def test_failed_warmup_makes_only_that_model_unavailable(
    index: dict[str, list[dict[str, str]]], client: httpclient.InferenceServerClient
) -> None:
    [row] = index["cold"]
    assert row["state"] == "UNAVAILABLE"
    assert row["reason"].startswith(
        "warm-up 'first' failed: execute raised RuntimeError: cold engine (model.py line"
    )
    assert index["text_stats"][0]["state"] == "READY"
    assert client.is_model_ready("text_stats")
    assert not client.is_model_ready("cold")
    assert not client.is_server_ready()  # Triton's strict readiness


def test_gpu_models_without_a_gpu_are_unavailable_with_the_reason(
    index: dict[str, list[dict[str, str]]],
) -> None:
    [engine] = index["engine"]
    assert engine["state"] == "UNAVAILABLE"
    assert "model 'engine' needs TensorRT and an NVIDIA GPU" in engine["reason"]
    if not HAVE_TORCH:
        pytest.skip("torch is not installed: no KIND_GPU torch model to check")
    import torch

    [torch_gpu] = index["torch_gpu"]
    if torch.cuda.is_available():
        assert torch_gpu["state"] == "READY"
    else:
        assert torch_gpu["state"] == "UNAVAILABLE"
        assert (
            "asks for instance kind KIND_GPU (GPU 0), but torch.cuda is not available"
            in (torch_gpu["reason"])
        )


def test_version_policy_all_serves_every_version(
    index: dict[str, list[dict[str, str]]], client: httpclient.InferenceServerClient
) -> None:
    assert sorted(row["version"] for row in index["versions_all"]) == ["1", "2"]
    assert all(row["state"] == "READY" for row in index["versions_all"])
    x = np.array([[1, 2]], dtype=np.float32)
    for version in ("1", "2"):
        result = _infer(client, "versions_all", {"x": x}, {"x": "FP32"}, version=version)
        np.testing.assert_array_equal(result.as_numpy("y"), x + 100 * int(version))
    # Without a version the newest answers.
    np.testing.assert_array_equal(
        _infer(client, "versions_all", {"x": x}, {"x": "FP32"}).as_numpy("y"), x + 200
    )


def test_version_policy_latest_serves_only_the_newest(
    index: dict[str, list[dict[str, str]]], stack: Stack
) -> None:
    assert [(row["version"], row["state"]) for row in index["versions_latest"]] == [("2", "READY")]
    body = {"inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [1, 2]}]}
    with httpx.Client(base_url=stack.url, timeout=10) as http:
        newest = http.post("/v2/models/versions_latest/versions/2/infer", json=body)
        assert newest.status_code == 200
        assert newest.json()["outputs"][0]["data"] == [201, 202]
        older = http.post("/v2/models/versions_latest/versions/1/infer", json=body)
        assert older.status_code == 404
        assert older.json()["error"] == (
            "Request for unknown model: 'versions_latest' version 1 is not found"
        )


def test_an_error_response_fails_only_its_own_request(
    client: httpclient.InferenceServerClient,
) -> None:
    values = [1.0, -1.0, 2.0, 3.0]
    batches = [{"x": np.full((1, 2), v, dtype=np.float32)} for v in values]
    pending = [client.async_infer("guarded", _tensors(b, {"x": "FP32"})) for b in batches]
    answers: list[np.ndarray | tuple[str | None, str]] = []
    for request in pending:
        try:
            answers.append(request.get_result().as_numpy("y"))
        except InferenceServerException as exc:
            answers.append((exc.status(), exc.message()))
    assert answers[1] == ("400", "negative input")
    for value, answer in zip(values, answers, strict=True):
        if value > 0:
            assert isinstance(answer, np.ndarray)
            np.testing.assert_array_equal(answer, np.full((1, 2), 2 * value))
    [stats] = client.get_inference_statistics("guarded")["model_stats"]
    assert stats["execution_count"] < len(values)  # the requests shared batches
