"""Triton's checksum repository agent on a real stack: a model whose file matches its
digest is served, one whose file was changed is unavailable with Triton's text in the
repository index, and an explicit load of it fails with that text."""

from __future__ import annotations

import hashlib
from pathlib import Path

import httpx

from sluice.scheduler.executor.redis_server import RedisServer
from tests.support.onnx_models import write_identity
from tests.support.stack import Stack


def _with_digest(model_dir: Path, digest: str) -> None:
    config = model_dir / "config.pbtxt"
    config.write_text(
        config.read_text()
        + '\nmodel_repository_agents { agents [ { name: "checksum" '
        + f'parameters {{ key: "MD5:1/model.onnx" value: "{digest}" }} }} ] }}\n'
    )


def test_a_model_is_served_only_while_its_files_match(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    repository = tmp_path / "repository"
    for name in ("checked", "tampered"):
        model_dir = write_identity(repository, name, ["FP32"])
        data = (model_dir / "1" / "model.onnx").read_bytes()
        _with_digest(model_dir, hashlib.md5(data, usedforsecurity=False).hexdigest())
    tampered = repository / "tampered" / "1" / "model.onnx"
    expected = hashlib.md5(tampered.read_bytes(), usedforsecurity=False).hexdigest()
    tampered.write_bytes(tampered.read_bytes() + b"\x00")
    got = hashlib.md5(tampered.read_bytes(), usedforsecurity=False).hexdigest()
    reason = f"Mismatched MD5 hash for file 1/model.onnx, expect: {expected}, got: {got}"

    stack = Stack(repository, redis_server.url, grpc_port=0)
    stack.start()
    try:
        with httpx.Client(base_url=stack.url, timeout=60) as http:
            rows = {row["name"]: row for row in http.post("/v2/repository/index").json()}
            assert rows["checked"]["state"] == "READY", rows
            assert rows["tampered"]["state"] == "UNAVAILABLE", rows
            assert rows["tampered"]["reason"] == reason
            body = {
                "inputs": [{"name": "IN_FP32", "shape": [1, 1], "datatype": "FP32", "data": [3]}]
            }
            answer = http.post("/v2/models/checked/infer", json=body)
            assert answer.status_code == 200, answer.text
    finally:
        stack.stop()


def test_an_explicit_load_of_a_changed_model_fails_with_the_reason(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    repository = tmp_path / "repository"
    model_dir = write_identity(repository, "m", ["FP32"])
    _with_digest(model_dir, "0" * 32)
    stack = Stack(repository, redis_server.url, grpc_port=0, args=["--model-control-mode=explicit"])
    stack.start()
    try:
        with httpx.Client(base_url=stack.url, timeout=60) as http:
            loaded = http.post("/v2/repository/models/m/load")
            assert loaded.status_code == 400, loaded.text
            assert (
                "Mismatched MD5 hash for file 1/model.onnx, expect: 000" in loaded.json()["error"]
            )
    finally:
        stack.stop()
