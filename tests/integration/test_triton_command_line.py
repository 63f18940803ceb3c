"""``sluice up`` in place of ``tritonserver``, with Triton's flags as a Triton user writes
them (see sluice/cli/triton_flags): one stack for the whole command line of the issue,
and a short start that --exit-on-error=true ends."""

from __future__ import annotations

import shutil
import socket
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from sluice.scheduler.executor.redis_server import RedisServer, free_port
from tests.support.onnx_models import write_identity
from tests.support.stack import Stack


def _wait_until(condition: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.2)
    return condition()


def _refused(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            return False
    except ConnectionRefusedError:
        return True


def _write_broken(repository: Path) -> None:
    (repository / "broken" / "1").mkdir(parents=True)
    (repository / "broken" / "config.pbtxt").write_text('name: "broken"\nmax_batch_size: x\n')


def test_tritons_command_line_serves_as_it_says(tmp_path: Path, redis_server: RedisServer) -> None:
    repository = tmp_path / "repository"
    write_identity(repository, "ident", ["FP32"])
    _write_broken(repository)
    stack = Stack(
        repository,
        redis_server.url,
        metrics_port=free_port(),
        args=[
            "--model-control-mode=poll",
            "--repository-poll-secs=1",
            "--load-model=ident",
            "--strict-readiness=false",
            "--exit-on-error=false",
            "--allow-grpc=false",
            "--allow-metrics",
            "false",
            "--log-verbose=1",
            "--backend-config=onnxruntime,enable-global-threadpool=1",
        ],
    )
    stack.start()
    try:
        warnings = [line for line in stack.stderr_lines if line.startswith("warning: --")]
        assert any("--backend-config=onnxruntime,enable-global-threadpool=1" in w for w in warnings)
        assert not any(line.startswith("gRPC at") for line in stack.stdout_lines)
        assert _refused(stack.grpc_port)  # --allow-grpc=false wins over --grpc-port
        assert _refused(stack.metrics_port)  # --allow-metrics=false closes the metrics port
        with httpx.Client(base_url=stack.url, timeout=30) as http:
            assert http.get("/v2/health/live").status_code == 200
            assert http.get("/metrics").status_code == 404
            # A broken model, yet ready: --strict-readiness=false; still running:
            # --exit-on-error=false.
            assert http.get("/v2/health/ready").status_code == 200
            index = {row["name"]: row for row in http.post("/v2/repository/index").json()}
            assert index["broken"]["state"] == "UNAVAILABLE"
            assert index["ident"]["state"] == "READY"

            # Poll mode, every second: a new version is served (made beside the
            # repository and renamed into place, as one would).
            staged = tmp_path / "staged"
            staged.mkdir()
            shutil.copy(repository / "ident" / "1" / "model.onnx", staged / "model.onnx")
            staged.rename(repository / "ident" / "2")

            def second_version_ready() -> bool:
                return http.get("/v2/models/ident/versions/2/ready").status_code == 200

            assert _wait_until(second_version_ready, 60)
    finally:
        stack.stop()


def test_exit_on_error_true_stops_naming_the_model(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    _write_broken(tmp_path)
    stack = Stack(tmp_path, redis_server.url, grpc_port=0, args=["--exit-on-error=true"])
    with pytest.raises(RuntimeError, match="did not become ready"):
        stack.start()
    assert stack.process is not None and stack.process.returncode == 1
    [error] = [line for line in stack.stderr_lines if line.startswith("error: ")]
    assert "--exit-on-error" in error and "model 'broken'" in error, error


_PIPE = """
name: "pipe"
platform: "ensemble"
max_batch_size: 4
input [ { name: "X" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ -1 ] } ]
ensemble_scheduling {
  step [
    { model_name: "tuned" model_version: -1
      input_map { key: "IN_FP32" value: "X" } output_map { key: "OUT_FP32" value: "Y" } }
  ]
}
"""


def test_model_config_name_serves_each_models_custom_configuration(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """--model-config-name=fast (in poll mode): ``tuned`` has configs/fast.pbtxt and a
    config.pbtxt that does not even parse, so it is served (by the executor, and through the
    ensemble ``pipe``, whose worker reads its composing model and checks its batch size of 4)
    only if every reader takes the custom file; ``plain`` has none and is served with its
    config.pbtxt, until one is added."""
    repository = tmp_path / "repository"
    tuned = write_identity(repository, "tuned", ["FP32"])
    custom = (tuned / "config.pbtxt").read_text().replace("max_batch_size: 8", "max_batch_size: 4")
    (tuned / "configs").mkdir()
    (tuned / "configs" / "fast.pbtxt").write_text(custom)
    (tuned / "configs" / "slow.pbtxt").write_text("not a configuration")
    (tuned / "config.pbtxt").write_text("max_batch_size: x\n")
    write_identity(repository, "plain", ["FP32"])
    (repository / "pipe" / "1").mkdir(parents=True)
    (repository / "pipe" / "config.pbtxt").write_text(_PIPE)
    args = ["--model-config-name=fast", "--model-control-mode=poll", "--repository-poll-secs=1"]
    stack = Stack(repository, redis_server.url, grpc_port=0, args=args)
    stack.start()
    try:
        with httpx.Client(base_url=stack.url, timeout=30) as http:
            index = {row["name"]: row["state"] for row in http.post("/v2/repository/index").json()}
            rows = http.post("/v2/repository/index").json()
            assert index == {"pipe": "READY", "plain": "READY", "tuned": "READY"}, rows
            assert http.get("/v2/models/tuned/config").json()["max_batch_size"] == 4
            assert http.get("/v2/models/plain/config").json()["max_batch_size"] == 8
            body = {
                "inputs": [
                    {"name": "X", "datatype": "FP32", "shape": [1, 3], "data": [1.0, 2.0, 3.0]}
                ]
            }
            answer = http.post("/v2/models/pipe/infer", json=body)
            assert answer.status_code == 200, answer.text
            assert answer.json()["outputs"][0]["data"] == [1.0, 2.0, 3.0]

            # Poll mode: a custom configuration added later is a change of configuration.
            plain = repository / "plain"
            (plain / "configs").mkdir()
            edited = (
                (plain / "config.pbtxt")
                .read_text()
                .replace("max_batch_size: 8", "max_batch_size: 2")
            )
            (plain / "configs" / "fast.pbtxt").write_text(edited)

            def plain_reconfigured() -> bool:
                return http.get("/v2/models/plain/config").json().get("max_batch_size") == 2

            assert _wait_until(plain_reconfigured, 60)
    finally:
        stack.stop()


def test_model_config_name_refuses_a_path(tmp_path: Path, redis_server: RedisServer) -> None:
    write_identity(tmp_path, "ident", ["FP32"])
    stack = Stack(tmp_path, redis_server.url, grpc_port=0, args=["--model-config-name=../x"])
    with pytest.raises(RuntimeError, match="did not become ready"):
        stack.start()
    assert stack.process is not None and stack.process.returncode == 2
    assert any("--model-config-name" in line for line in stack.stderr_lines), stack.stderr_lines


def test_default_max_batch_size_is_every_readers(tmp_path: Path, redis_server: RedisServer) -> None:
    """--backend-config=onnxruntime,default-max-batch-size=16: ``auto`` has no config.pbtxt
    and batches up to 16 with the dynamic batcher; the ensemble ``pipe`` (batches of up to
    16, which its composing model must take) is served only if its worker reads ``auto``
    with the same default (with Triton's 4 it would refuse it)."""
    repository = tmp_path / "repository"
    auto = write_identity(repository, "auto", ["FP32"])
    (auto / "config.pbtxt").unlink()
    (repository / "pipe" / "1").mkdir(parents=True)
    pipe = _PIPE.replace('"tuned"', '"auto"').replace("max_batch_size: 4", "max_batch_size: 16")
    (repository / "pipe" / "config.pbtxt").write_text(pipe)
    args = ["--backend-config=onnxruntime,default-max-batch-size=16"]
    stack = Stack(repository, redis_server.url, grpc_port=0, args=args)
    stack.start()
    try:
        with httpx.Client(base_url=stack.url, timeout=30) as http:
            rows = http.post("/v2/repository/index").json()
            assert {row["name"]: row["state"] for row in rows} == {
                "auto": "READY",
                "pipe": "READY",
            }, rows
            config = http.get("/v2/models/auto/config").json()
            assert config["max_batch_size"] == 16
            assert "dynamic_batching" in config
            body = {
                "inputs": [{"name": "X", "datatype": "FP32", "shape": [2, 1], "data": [1.0, 2.0]}]
            }
            answer = http.post("/v2/models/pipe/infer", json=body)
            assert answer.status_code == 200, answer.text
            assert answer.json()["outputs"][0]["data"] == [1.0, 2.0]
    finally:
        stack.stop()
