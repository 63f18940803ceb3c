"""Triton's response cache on a real stack (``SLUICE_RESPONSE_CACHE_BYTES``, a model's
``response_cache { enable: true }``): an identical request is answered from the cache over
HTTP and gRPC without reaching the model, Triton's statistics and metrics count hits and
misses, a tenant never gets another's cached answer, the cache stays within its bytes, a
model without the setting is never cached, and a model loaded again never gets the answers
of its former self."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from redis import Redis

from sluice.core.keys import Keys
from sluice.scheduler.executor.redis_server import RedisServer
from tests.support.onnx_models import write_identity
from tests.support.stack import Stack

CACHE_BYTES = 16 * 1024
"""Room for about a dozen of the answers below (1 KiB of outputs each)."""
WIDTH = 256


_TENSORS = f"""max_batch_size: 8
input [ {{ name: "X" data_type: TYPE_FP32 dims: [ {WIDTH} ] }} ]
output [ {{ name: "Y" data_type: TYPE_FP32 dims: [ {WIDTH} ] }} ]
"""
WRAPPED = (
    'name: "wrapped_cached"\nplatform: "ensemble"\n'
    + _TENSORS
    + """ensemble_scheduling { step [ { model_name: "cached" model_version: -1
  input_map { key: "IN_FP32" value: "X" } output_map { key: "OUT_FP32" value: "Y" } } ] }
"""
)
"""An ensemble whose one step is the cached model."""
BLS_CONFIG = 'name: "bls_cached"\nbackend: "python"\n' + _TENSORS
BLS = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            answer = pb_utils.InferenceRequest(
                model_name="cached",
                requested_output_names=["OUT_FP32"],
                inputs=[pb_utils.Tensor("IN_FP32", x)],
            ).exec()
            if answer.has_error():
                raise pb_utils.TritonModelException(answer.error().message())
            y = pb_utils.get_output_tensor_by_name(answer, "OUT_FP32").as_numpy()
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", y)]))
        return responses
"""
"""A Triton Python model that calls the cached model (BLS)."""


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("response_cache")
    write_identity(root, "cached", ["FP32"], dims=(WIDTH,), extra="response_cache { enable: true }")
    write_identity(root, "plain", ["FP32"], dims=(WIDTH,))
    for name, text in (("wrapped_cached", WRAPPED), ("bls_cached", BLS_CONFIG)):
        (root / name / "1").mkdir(parents=True)
        (root / name / "config.pbtxt").write_text(text)
    (root / "bls_cached" / "1" / "model.py").write_text(BLS)
    env = {
        "SLUICE_RESPONSE_CACHE_BYTES": str(CACHE_BYTES),
        "SLUICE_API_KEYS": "team-a:key-a,team-b:key-b",
    }
    stack = Stack(root, redis_server.url, env=env)
    stack.start()
    yield stack
    stack.stop()


def _body(value: float) -> dict[str, Any]:
    data = [value] * WIDTH
    return {"inputs": [{"name": "IN_FP32", "shape": [1, WIDTH], "datatype": "FP32", "data": data}]}


def _infer(stack: Stack, model: str, value: float, key: str = "key-a") -> list[float]:
    headers = {"Authorization": f"Bearer {key}"}
    with httpx.Client(base_url=stack.url, timeout=30, headers=headers) as http:
        response = http.post(f"/v2/models/{model}/infer", json=_body(value))
    assert response.status_code == 200, response.text
    return cast(list[float], response.json()["outputs"][0]["data"])


def _stats(stack: Stack, model: str) -> dict[str, Any]:
    headers = {"Authorization": "Bearer key-a"}
    with httpx.Client(base_url=stack.url, timeout=30, headers=headers) as http:
        stats = http.get(f"/v2/models/{model}/stats").json()["model_stats"][0]
    return cast(dict[str, Any], stats)


def test_an_identical_request_is_answered_from_the_cache(stack: Stack) -> None:
    before = _stats(stack, "cached")
    first = _infer(stack, "cached", 1.5)
    again = _infer(stack, "cached", 1.5)
    assert first == again == [1.5] * WIDTH
    after = _stats(stack, "cached")
    inference = {k: after["inference_stats"][k]["count"] for k in ("cache_hit", "cache_miss")}
    was = {k: before["inference_stats"][k]["count"] for k in ("cache_hit", "cache_miss")}
    assert inference == {"cache_hit": was["cache_hit"] + 1, "cache_miss": was["cache_miss"] + 1}
    # The hit is a success that never reached the model (Triton's counts).
    assert after["execution_count"] == before["execution_count"] + 1
    assert after["inference_count"] == before["inference_count"] + 1
    success = (
        after["inference_stats"]["success"]["count"] - before["inference_stats"]["success"]["count"]
    )
    assert success == 2
    assert after["inference_stats"]["cache_hit"]["ns"] > 0

    # Over gRPC too: the answer kept is encoded for each request's own wire.
    client = grpcclient.InferenceServerClient(stack.grpc_address)
    try:
        tensor = grpcclient.InferInput("IN_FP32", [1, WIDTH], "FP32")
        tensor.set_data_from_numpy(np.full((1, WIDTH), 1.5, np.float32))
        result = client.infer("cached", [tensor], headers={"authorization": "Bearer key-a"})
    finally:
        client.close()
    assert result.as_numpy("OUT_FP32").tolist() == [[1.5] * WIDTH]
    assert _stats(stack, "cached")["execution_count"] == after["execution_count"]

    with httpx.Client(base_url=stack.url, timeout=30) as http:
        metrics = http.get("/metrics", headers={"Authorization": "Bearer key-a"}).text
    assert 'nv_cache_num_hits_per_model{model="cached",version="1"}' in metrics
    assert 'nv_cache_num_misses_per_model{model="cached",version="1"}' in metrics


def test_another_tenant_never_gets_a_cached_answer(stack: Stack) -> None:
    _infer(stack, "cached", 2.5, key="key-a")
    _infer(stack, "cached", 2.5, key="key-a")  # (a hit for team-a)
    before = _stats(stack, "cached")["execution_count"]
    assert _infer(stack, "cached", 2.5, key="key-b") == [2.5] * WIDTH
    assert _stats(stack, "cached")["execution_count"] == before + 1  # computed for team-b


def test_a_model_without_the_setting_is_never_cached(stack: Stack) -> None:
    before = _stats(stack, "plain")
    for _ in range(3):
        assert _infer(stack, "plain", 3.5) == [3.5] * WIDTH
    after = _stats(stack, "plain")
    assert after["execution_count"] - before["execution_count"] == 3
    assert after["inference_stats"]["cache_hit"]["count"] == 0
    assert after["inference_stats"]["cache_miss"]["count"] == 0


def test_the_cache_stays_within_its_bytes(stack: Stack) -> None:
    for value in range(40):  # far more answers than fit
        _infer(stack, "cached", 100.0 + value)
    keys = Keys(stack.namespace)
    assert stack.redis_url is not None
    redis = Redis.from_url(stack.redis_url)
    try:
        total = int(cast(bytes, redis.get(f"{keys.cache_index()}:total")))
        entries = redis.zcard(keys.cache_index())
        sizes = [
            int(size)
            for size in cast(
                dict[bytes, bytes], redis.hgetall(f"{keys.cache_index()}:sizes")
            ).values()
        ]
    finally:
        redis.close()
    assert 0 < total <= CACHE_BYTES
    assert total == sum(sizes) and entries == len(sizes)
    assert entries < 40
    # The most recent answers are the ones kept: the last one is a hit.
    hits = _stats(stack, "cached")["inference_stats"]["cache_hit"]["count"]
    _infer(stack, "cached", 139.0)
    assert _stats(stack, "cached")["inference_stats"]["cache_hit"]["count"] == hits + 1


def test_hits_on_a_grpc_stream_let_the_next_request_go(stack: Stack) -> None:
    """A hit is never queued: the stream's next request must not wait for its turn."""
    import queue

    answers: queue.Queue[Any] = queue.Queue()
    client = grpcclient.InferenceServerClient(stack.grpc_address)
    try:
        client.start_stream(
            callback=lambda result, error: answers.put((result, error)),
            headers={"authorization": "Bearer key-a"},
        )
        for index in range(4):
            tensor = grpcclient.InferInput("IN_FP32", [1, WIDTH], "FP32")
            tensor.set_data_from_numpy(np.full((1, WIDTH), 7.5, np.float32))
            client.async_stream_infer("cached", [tensor], request_id=str(index))
        got = []
        for _ in range(4):
            result, error = answers.get(timeout=30)
            assert error is None, error
            got.append(result.as_numpy("OUT_FP32").tolist())
    finally:
        client.stop_stream()
        client.close()
    assert got == [[[7.5] * WIDTH]] * 4


def _infer_x(stack: Stack, model: str, value: float, key: str) -> list[float]:
    body = {
        "inputs": [{"name": "X", "shape": [1, WIDTH], "datatype": "FP32", "data": [value] * WIDTH}]
    }
    with httpx.Client(base_url=stack.url, timeout=60) as http:
        response = http.post(
            f"/v2/models/{model}/infer", json=body, headers={"Authorization": f"Bearer {key}"}
        )
    assert response.status_code == 200, response.text
    return cast(list[float], response.json()["outputs"][0]["data"])


def test_ensemble_steps_and_bls_calls_use_the_cache_of_the_model_they_call(
    stack: Stack,
) -> None:
    """As in Triton, the cache of a composing model (or of a model a Python model calls)
    answers those calls too; still per tenant."""
    for model, value in (("wrapped_cached", 4.5), ("bls_cached", 5.5)):
        before = _stats(stack, "cached")
        assert _infer_x(stack, model, value, "key-a") == [value] * WIDTH
        assert _infer_x(stack, model, value, "key-a") == [value] * WIDTH
        after = _stats(stack, "cached")
        assert after["execution_count"] == before["execution_count"] + 1, model
        hits = after["inference_stats"]["cache_hit"]["count"]
        assert hits == before["inference_stats"]["cache_hit"]["count"] + 1, model
        assert _infer_x(stack, model, value, "key-b") == [value] * WIDTH
        assert _stats(stack, "cached")["execution_count"] == after["execution_count"] + 1


SCALED = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", x * {factor})]))
        return responses
"""
"""A Triton Python model whose "weights" are ``factor``."""


def test_a_reloaded_model_never_gets_its_former_answers(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """A model loaded again with new weights (same name, same version) answers with them:
    what the cache kept of its former self is not served after the load, nor after an
    unload and a load."""
    model_dir = tmp_path / "scaled"
    (model_dir / "1").mkdir(parents=True)
    (model_dir / "config.pbtxt").write_text(
        'name: "scaled"\nbackend: "python"\n' + _TENSORS + "response_cache { enable: true }\n"
    )
    (model_dir / "1" / "model.py").write_text(SCALED.format(factor=2))
    stack = Stack(
        tmp_path,
        redis_server.url,
        env={"SLUICE_RESPONSE_CACHE_BYTES": str(CACHE_BYTES)},
        args=["--model-control-mode", "explicit", "--load-model", "scaled"],
    )
    stack.start()
    try:
        with httpx.Client(base_url=stack.url, timeout=120) as http:

            def infer() -> float:
                body = {
                    "inputs": [
                        {"name": "X", "shape": [1, WIDTH], "datatype": "FP32", "data": [1] * WIDTH}
                    ]
                }
                response = http.post("/v2/models/scaled/infer", json=body)
                assert response.status_code == 200, response.text
                return cast(float, response.json()["outputs"][0]["data"][0])

            def load() -> None:
                response = http.post("/v2/repository/models/scaled/load")
                assert response.status_code == 200, response.text

            assert infer() == infer() == 2.0
            stats = http.get("/v2/models/scaled/stats").json()["model_stats"][0]
            assert stats["inference_stats"]["cache_hit"]["count"] == 1
            (model_dir / "1" / "model.py").write_text(SCALED.format(factor=3))
            load()
            assert infer() == 3.0
            (model_dir / "1" / "model.py").write_text(SCALED.format(factor=4))
            assert http.post("/v2/repository/models/scaled/unload").status_code == 200
            load()
            assert infer() == 4.0
    finally:
        stack.stop()
