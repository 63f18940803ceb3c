"""``sluice up`` as a user runs it: broken models, Triton repositories as they are, clean stop."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np
import tritonclient.http as httpclient
from redis import Redis

from sluice import __version__
from tests.support import procs
from tests.support.onnx_models import identity_model, save, write_identity
from tests.support.stack import READY_PREFIX, Stack


def test_broken_models_are_unavailable_with_a_reason_and_others_serve(stack: Stack) -> None:
    with httpx.Client(base_url=stack.url, timeout=10) as http:
        index = {row["name"]: row for row in http.post("/v2/repository/index").json()}
        assert index["corrupt_model"]["state"] == "UNAVAILABLE"
        assert "onnxruntime cannot load" in index["corrupt_model"]["reason"]
        assert index["broken_config"]["state"] == "UNAVAILABLE"
        assert "config.pbtxt" in index["broken_config"]["reason"]
        for model in ("corrupt_model", "broken_config"):
            # (Triton's answer to a model whose load failed, asked without a version)
            response = http.post(f"/v2/models/{model}/infer", content=b'{"inputs": []}')
            assert response.status_code == 404
            assert response.json()["error"].startswith(
                f"Request for unknown model: '{model}' has no available versions; "
            )
            assert "unavailable" in response.json()["error"]
            assert http.get(f"/v2/models/{model}/ready").status_code in (400, 503)
        # Triton's strict readiness: not ready while a model is unavailable.
        assert http.get("/v2/health/ready").status_code == 400
        assert http.get("/v2/models/iris/ready").status_code == 200


def test_up_prints_a_line_per_model_then_ready(stack: Stack) -> None:
    lines = [line.rstrip("\n") for line in stack.stdout_lines]
    ready_at = next(n for n, line in enumerate(lines) if line.startswith(READY_PREFIX))
    assert lines[ready_at] == f"{READY_PREFIX}{stack.url}"
    assert lines[ready_at - 1] == f"gRPC at {stack.grpc_address}"
    models = lines[: ready_at - 1]
    assert "model 'iris' version 1 ready (1 instance)" in models, models
    assert "model 'nobatch' version 1 ready (1 instance)" in models
    broken = [line for line in models if line.startswith("model 'broken_config' unavailable: ")]
    assert len(broken) == 1 and "config.pbtxt" in broken[0], models
    corrupt = [line for line in models if line.startswith("model 'corrupt_model' version 1 unava")]
    assert len(corrupt) == 1 and "onnxruntime cannot load" in corrupt[0], models
    assert len(models) == len(set(models)) == 8, models  # each model once, nothing else


def test_triton_repository_without_config_is_served_and_stops_cleanly(
    tmp_path: Path, start_stack: Callable[..., Stack]
) -> None:
    save(identity_model(["FP32"], [None, 3]), tmp_path / "plain_onnx" / "1" / "model.onnx")
    write_identity(tmp_path, "second", ["INT32"], max_batch_size=0, dims=(2,))
    stack = start_stack(tmp_path)
    assert stack.process is not None
    children = procs.children(stack.process.pid)
    gateways, workers = procs.gateway_pids(stack.process.pid), procs.worker_pids(stack.process.pid)
    assert gateways and len(workers) == 2, children  # the gateways and one worker per model
    assert set(children) == {*gateways, *workers}, children

    with httpclient.InferenceServerClient(stack.address) as client:
        config = client.get_model_config("plain_onnx")
        assert config["max_batch_size"] == 4
        assert config["input"][0]["dims"] == [3]
        data = np.array([[1, 2, 3], [4, 5, 6]], dtype=np.float32)
        tensor = httpclient.InferInput("IN_FP32", [2, 3], "FP32")
        tensor.set_data_from_numpy(data)
        np.testing.assert_array_equal(
            client.infer("plain_onnx", [tensor]).as_numpy("OUT_FP32"), data
        )

    assert stack.stop() == 0
    assert stack.stdout_lines[-2:] == ["Stopping Sluice ...\n", "Sluice stopped.\n"]
    deadline = time.monotonic() + 10
    while any(procs.alive(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(procs.alive(pid) for pid in children)


def test_missing_redis_server_is_reported_not_installed(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_")}
    env["PATH"] = str(tmp_path)
    result = subprocess.run(
        [sys.executable, "-m", "sluice.cli", "up", "--model-repository", str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "redis-server was not found" in result.stderr
    assert "SLUICE_REDIS_URL" in result.stderr


def test_missing_repository_is_a_clear_error(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "sluice.cli", "up", "--model-repository", str(tmp_path / "nope")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "nope" in result.stderr


def test_empty_repository_warns_and_serves(
    tmp_path: Path, start_stack: Callable[..., Stack]
) -> None:
    stack = start_stack(tmp_path)
    assert procs.wait_until(
        lambda: any(
            "has no models" in line and str(tmp_path) in line for line in stack.stderr_lines
        ),
        5,
    )
    assert stack.stdout_lines == [
        f"gRPC at {stack.grpc_address}\n",
        f"{READY_PREFIX}{stack.url}\n",
    ]
    with httpx.Client(base_url=stack.url, timeout=10) as http:
        assert http.post("/v2/repository/index").json() == []
        assert http.get("/v2/health/ready").status_code == 200


def test_version() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "sluice.cli", "--version"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"sluice {__version__}\n"


def test_every_option_has_a_help_text() -> None:
    import typer.main

    from sluice.cli import app

    group = typer.main.get_command(app)
    commands = [group, *group.commands.values()]  # type: ignore[attr-defined]
    options = [(c.name, p) for c in commands for p in c.params if p.param_type_name == "option"]
    assert len(options) > 10
    assert [f"{name} --{p.name}" for name, p in options if not getattr(p, "help", None)] == []


def test_private_redis_needs_its_password_which_is_never_shown(tmp_path: Path) -> None:
    """Without SLUICE_REDIS_URL: a redis-server with a password made for this start, given
    to the children in their environment only, and maxmemory with noeviction; listening on
    every interface without keys is warned about, naming the setting."""
    no_keys = {f"SLUICE_{name}": "" for name in ("API_KEYS", "API_KEYS_FILE", "ADMIN_KEYS")}
    env = {**no_keys, "SLUICE_ADMIN_KEYS_FILE": "", "SLUICE_REDIS_MAXMEMORY": str(96 << 20)}
    stack = Stack(tmp_path, None, env=env, args=["--http-host", "0.0.0.0"])
    try:
        stack.start()
        assert stack.process is not None and stack.redis_url is not None
        url = urllib.parse.urlsplit(stack.redis_url)
        assert url.hostname == "127.0.0.1" and url.password and len(url.password) >= 32
        with socket.create_connection((url.hostname, url.port), timeout=2) as raw:
            raw.sendall(b"PING\r\n")
            assert raw.recv(100).startswith(b"-NOAUTH")
        client = Redis.from_url(stack.redis_url, decode_responses=True)
        assert client.config_get("maxmemory") == {"maxmemory": str(96 << 20)}
        assert client.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
        assert client.config_get("bind") == {"bind": "127.0.0.1"}
        client.close()

        everyone = [stack.process.pid, *procs.children(stack.process.pid)]
        assert len(everyone) >= 3  # sluice up, its redis-server, the gateway
        for pid in everyone:
            assert url.password not in " ".join(procs.cmdline(pid)), procs.cmdline(pid)
        warnings = [line for line in stack.stderr_lines if "without API keys" in line]
        assert len(warnings) == 1 and "0.0.0.0" in warnings[0], stack.stderr_lines
        assert "SLUICE_API_KEYS" in warnings[0]
    finally:
        stack.stop()
    printed = "".join(stack.stdout_lines + stack.stderr_lines)
    assert url.password not in printed
    assert "private redis-server at 127.0.0.1:" in printed
