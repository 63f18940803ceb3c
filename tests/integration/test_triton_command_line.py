"""``sluice up`` in place of ``tritonserver``, with Triton's flags as a Triton user writes
them (see sluice/cli/triton_flags.py): one stack for the whole command line of the issue,
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
            assert http.get("/v2/health/live").json() == {"live": True}
            assert http.get("/metrics").status_code == 404
            # A broken model, yet ready: --strict-readiness=false; still running:
            # --exit-on-error=false.
            assert http.get("/v2/health/ready").json() == {"ready": True}
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
