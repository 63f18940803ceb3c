"""``sluice up`` with a snapshot folder (SLUICE_SNAPSHOT_DIR, TorchServe's snapshots), in
explicit mode: a restart serves again what was loaded through the API, each model as it
was loaded (a configuration of its own, files alone), and an unloaded model stays unloaded
after the next restart."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import httpx

from sluice.scheduler.executor.redis_server import RedisServer
from tests.support.onnx_models import write_identity
from tests.support.stack import Stack

BODY = {"inputs": [{"name": "IN_FP32", "shape": [1, 2], "datatype": "FP32", "data": [1, 2]}]}


def _start(repository: Path, redis_server: RedisServer, snapshots: Path) -> Stack:
    stack = Stack(
        repository,
        redis_server.url,
        env={"SLUICE_SNAPSHOT_DIR": str(snapshots)},
        grpc_port=0,
        args=["--model-control-mode=explicit", "--load-model=ident"],
    )
    stack.start()
    return stack


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

    stack = _start(repository, redis_server, snapshots)
    try:
        with httpx.Client(base_url=stack.url, timeout=120) as http:
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
    finally:
        stack.stop()

    # A new start (a new namespace: nothing of the first one is in Redis).
    stack = _start(repository, redis_server, snapshots)
    try:
        with httpx.Client(base_url=stack.url, timeout=120) as http:
            states = _states(http)
            assert states["tuned"] == "READY" and states["uploaded"] == "READY", states
            assert states["plain"] != "READY", states
            assert http.get("/v2/models/tuned/config").json()["max_batch_size"] == 2
            answer = http.post("/v2/models/uploaded/infer", json=BODY)
            assert answer.status_code == 200, answer.text
            assert http.post("/v2/repository/models/tuned/unload").status_code == 200
    finally:
        stack.stop()

    stack = _start(repository, redis_server, snapshots)
    try:
        with httpx.Client(base_url=stack.url, timeout=120) as http:
            states = _states(http)
            assert states["tuned"] != "READY" and states["uploaded"] == "READY", states
    finally:
        stack.stop()
