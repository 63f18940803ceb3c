"""``sluice up`` with a snapshot folder (SLUICE_SNAPSHOT_DIR, TorchServe's snapshots), in
explicit mode: a restart serves again what was loaded through the API, each model as it
was loaded (a configuration of its own, files alone), and an unloaded model stays unloaded
after the next restart."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx

from sluice.scheduler.executor.redis_server import RedisServer
from tests.support.onnx_models import write_identity
from tests.support.stack import Stack

BODY = {"inputs": [{"name": "IN_FP32", "shape": [1, 2], "datatype": "FP32", "data": [1, 2]}]}


@contextlib.contextmanager
def _served(repository: Path, redis_server: RedisServer, snapshots: Path) -> Iterator[httpx.Client]:
    """One start of ``sluice up`` (a namespace of its own: nothing of an earlier start is
    in Redis), and a client of it; stopped at the end."""
    stack = Stack(
        repository,
        redis_server.url,
        env={"SLUICE_SNAPSHOT_DIR": str(snapshots)},
        grpc_port=0,
        args=["--model-control-mode=explicit", "--load-model=ident"],
    )
    stack.start()
    try:
        with httpx.Client(base_url=stack.url, timeout=120) as http:
            yield http
    finally:
        stack.stop()


def _states(http: httpx.Client) -> dict[str, str]:
    return {row["name"]: row.get("state", "") for row in http.post("/v2/repository/index").json()}


def test_a_restart_serves_what_was_loaded_as_it_was_loaded(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    repository = tmp_path / "repository"
    for name in ("ident", "tuned", "plain"):
        write_identity(repository, name, ["FP32"])
    onnx = (repository / "ident" / "1" / "model.onnx").read_bytes()
    snapshots = tmp_path / "snapshots"

    with _served(repository, redis_server, snapshots) as http:
        config = http.get("/v2/models/ident/config").json()
        tuned = dict(config, name="tuned", max_batch_size=2)
        loaded = http.post(
            "/v2/repository/models/tuned/load",
            json={"parameters": {"config": json.dumps(tuned)}},
        )
        assert loaded.status_code == 200, loaded.text
        files = {
            "config": json.dumps(dict(config, name="uploaded")),
            "file:1/model.onnx": base64.b64encode(onnx).decode(),
        }
        uploaded = http.post("/v2/repository/models/uploaded/load", json={"parameters": files})
        assert uploaded.status_code == 200, uploaded.text
        assert http.post("/v2/repository/models/plain/load").status_code == 200
        assert http.post("/v2/repository/models/plain/unload").status_code == 200

    with _served(repository, redis_server, snapshots) as http:
        states = _states(http)
        assert states["tuned"] == "READY" and states["uploaded"] == "READY", states
        assert states["plain"] != "READY", states
        assert http.get("/v2/models/tuned/config").json()["max_batch_size"] == 2
        answer = http.post("/v2/models/uploaded/infer", json=BODY)
        assert answer.status_code == 200, answer.text
        assert http.post("/v2/repository/models/tuned/unload").status_code == 200

    with _served(repository, redis_server, snapshots) as http:
        states = _states(http)
        assert states["tuned"] != "READY" and states["uploaded"] == "READY", states


def test_a_snapshot_folder_that_cannot_be_written_stops_the_start(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """A misplaced SLUICE_SNAPSHOT_DIR (here a file) is said at start, naming the setting,
    instead of losing every snapshot later."""
    repository = tmp_path / "repository"
    write_identity(repository, "ident", ["FP32"])
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    env = dict(
        os.environ,
        SLUICE_REDIS_URL=redis_server.url,
        SLUICE_NAMESPACE=f"snap{os.getpid()}",
        SLUICE_SNAPSHOT_DIR=str(blocked),
    )
    argv = [sys.executable, "-m", "sluice.cli", "up", "--model-repository", str(repository)]
    result = subprocess.run(
        [*argv, "--model-control-mode=explicit", "--http-port=0", "--grpc-port=0"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert result.returncode != 0
    assert "SLUICE_SNAPSHOT_DIR: cannot write the model snapshot in" in result.stderr
