"""``sluice up --model-repository A --model-store=B``, as a Triton user starts tritonserver
with two repositories: the models of both served, an ensemble of one composing a model of
the other, a name found in both unavailable with Triton's reason, and poll mode following
both (a model added to either is served; a name no longer held twice is served again)."""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import numpy as np
import tritonclient.http as httpclient

from sluice.scheduler.executor.redis_server import RedisServer
from tests.support.onnx_models import write_identity
from tests.support.procs import wait_until
from tests.support.stack import Stack

_PIPE = """
name: "pipe"
platform: "ensemble"
max_batch_size: 8
input [ { name: "X" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ -1 ] } ]
ensemble_scheduling {
  step [
    { model_name: "beta" model_version: -1
      input_map { key: "IN_FP32" value: "X" } output_map { key: "OUT_FP32" value: "Y" } }
  ]
}
"""


def _index(http: httpx.Client) -> dict[str, dict[str, str]]:
    return {row["name"]: row for row in http.post("/v2/repository/index").json()}


def _infer(address: str, model: str, name_in: str, name_out: str) -> np.ndarray:
    data = np.arange(6, dtype=np.float32).reshape(2, 3)
    with httpclient.InferenceServerClient(address) as client:
        tensor = httpclient.InferInput(name_in, list(data.shape), "FP32")
        tensor.set_data_from_numpy(data)
        result = client.infer(model, [tensor]).as_numpy(name_out)
    assert result is not None
    np.testing.assert_array_equal(result, data)
    return result


def test_two_repositories_are_served_together_as_triton_serves_them(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    write_identity(first, "alpha", ["FP32"])
    write_identity(first, "dup", ["FP32"])
    (first / "pipe" / "1").mkdir(parents=True)
    (first / "pipe" / "config.pbtxt").write_text(_PIPE)
    write_identity(second, "beta", ["FP32"])
    write_identity(second, "dup", ["FP32"])
    stack = Stack(
        first,
        redis_server.url,
        grpc_port=0,
        env={"SLUICE_REPOSITORY_CACHE_DIR": str(tmp_path / "cache")},
        args=[f"--model-store={second}", "--model-control-mode=poll", "--repository-poll-secs=1"],
    )
    stack.start()
    try:
        with httpx.Client(base_url=stack.url, timeout=30) as http:
            index = _index(http)
            assert {name: row["state"] for name, row in index.items()} == {
                "alpha": "READY",
                "beta": "READY",
                "pipe": "READY",
                "dup": "UNAVAILABLE",
            }
            assert index["dup"]["reason"] == "model appears in two or more repositories"
            assert http.get("/v2/models/dup/ready").status_code == 400
            _infer(stack.address, "alpha", "IN_FP32", "OUT_FP32")
            _infer(stack.address, "pipe", "X", "Y")  # first's ensemble, second's model

            write_identity(second, "gamma", ["FP32"])
            shutil.rmtree(second / "dup")

            def both_served() -> bool:
                states = {name: row.get("state") for name, row in _index(http).items()}
                return states.get("gamma") == "READY" and states.get("dup") == "READY"

            assert wait_until(both_served, 60), _index(http)
            _infer(stack.address, "gamma", "IN_FP32", "OUT_FP32")
            _infer(stack.address, "dup", "IN_FP32", "OUT_FP32")
    finally:
        stack.stop()


def test_an_explicit_load_finds_a_model_added_to_any_repository(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    write_identity(first, "alpha", ["FP32"])
    write_identity(first, "dup", ["FP32"])
    write_identity(second, "dup", ["FP32"])
    stack = Stack(
        first,
        redis_server.url,
        grpc_port=0,
        env={"SLUICE_REPOSITORY_CACHE_DIR": str(tmp_path / "cache")},
        args=["--model-repository", str(second), "--model-control-mode=explicit"],
    )
    stack.start()
    try:
        with httpx.Client(base_url=stack.url, timeout=60) as http:
            # As in Triton's index in every mode: the name two repositories hold is listed,
            # unavailable, and cannot be loaded.
            dup = _index(http)["dup"]
            assert (dup["state"], dup["reason"]) == (
                "UNAVAILABLE",
                "model appears in two or more repositories",
            )
            assert http.post("/v2/repository/models/dup/load").status_code == 400
            assert http.post("/v2/repository/models/gamma/load").status_code == 400
            write_identity(second, "gamma", ["FP32"])
            answer = http.post("/v2/repository/models/gamma/load")
            assert answer.status_code == 200, answer.text
            _infer(stack.address, "gamma", "IN_FP32", "OUT_FP32")
    finally:
        stack.stop()
