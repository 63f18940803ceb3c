"""Hostile model loads against a running stack: a load's configuration names files
(``label_filename``, ``default_model_filename``) and models (an ensemble's steps), and none
of them may reach outside the model's own folder (the server's files, the operator's
repository). Each is refused with 400 naming the field, over HTTP and gRPC, and the stack
goes on serving."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from tritonclient.grpc import service_pb2, service_pb2_grpc

from sluice.scheduler.executor.redis_server import RedisServer
from tests.support.model_files import DOUBLE_MODEL, write_fragile
from tests.support.stack import Stack

DOUBLE = {"inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [1, 2]}]}
SECRET = "only-the-server-may-read-this"


@pytest.fixture(scope="module")
def secret_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A file of the server's, outside the repository, that no load may read."""
    path = tmp_path_factory.mktemp("server") / "secret.txt"
    path.write_text(f"{SECRET}\n{SECRET}\n")
    return path


@pytest.fixture(scope="module")
def explicit(
    tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer
) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("hostile-loads")
    write_fragile(root, "double")
    (root / "double" / "1" / "model.py").write_text(DOUBLE_MODEL)
    stack = Stack(
        root, redis_server.url, args=["--model-control-mode", "explicit", "--load-model", "double"]
    )
    stack.start()
    yield stack
    stack.stop()


def _config(**extra: Any) -> dict[str, Any]:
    return {
        "backend": "python",
        "max_batch_size": 0,
        "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": [2]}],
        "output": [{"name": "y", "data_type": "TYPE_FP32", "dims": [2]}],
        **extra,
    }


def _with_labels(path: str) -> dict[str, Any]:
    config = _config()
    config["output"][0]["label_filename"] = path
    return config


def _ensemble(step: str) -> dict[str, Any]:
    return _config(
        backend="",
        platform="ensemble",
        ensemble_scheduling={
            "step": [
                {
                    "model_name": step,
                    "model_version": -1,
                    "input_map": {"x": "x"},
                    "output_map": {"y": "y"},
                }
            ]
        },
    )


def _load(stack: Stack, model: str, config: dict[str, Any], files: bool) -> httpx.Response:
    parameters: dict[str, str] = {"config": json.dumps(config)}
    if files:
        parameters["file:1/model.py"] = base64.b64encode(DOUBLE_MODEL.encode()).decode()
    return httpx.post(
        f"{stack.url}/v2/repository/models/{model}/load",
        json={"parameters": parameters},
        timeout=150,
    )


def _cases(secret_file: Path) -> list[tuple[str, dict[str, Any], str]]:
    up = "../" * 12
    return [
        ("double", _with_labels(str(secret_file)), "label_filename"),
        ("double", _with_labels(f"{up}{str(secret_file).lstrip('/')}"), "label_filename"),
        ("double", _with_labels("1/../../double/config.pbtxt"), "label_filename"),
        ("double", _with_labels("labels\0.txt"), "label_filename"),
        ("double", _config(default_model_filename=str(secret_file)), "default_model_filename"),
        ("double", _config(default_model_filename="/no/such/model.py"), "default_model_filename"),
        ("double", _config(default_model_filename="../../model.py"), "default_model_filename"),
        ("double", _config(default_model_filename=".."), "default_model_filename"),
        ("double", _config(default_model_filename="a\0.py"), "default_model_filename"),
        ("pipeline", _ensemble(f"{up}etc"), "model_name"),
        ("pipeline", _ensemble(".."), "model_name"),
        ("pipeline", _ensemble("/etc"), "model_name"),
    ]


@pytest.mark.parametrize("files", [False, True], ids=["config", "config-and-files"])
def test_a_loads_configuration_names_no_file_outside_the_model(
    explicit: Stack, secret_file: Path, files: bool
) -> None:
    for model, config, field in _cases(secret_file):
        if model == "pipeline" and not files:
            continue  # (no such model in the repository: nothing to override)
        answer = _load(explicit, model, config, files)
        assert answer.status_code == 400, (config, answer.text)
        assert field in answer.json()["error"], (config, answer.text)
        assert SECRET not in answer.text
    infer = httpx.post(f"{explicit.url}/v2/models/double/infer", json=DOUBLE, timeout=30)
    assert infer.status_code == 200, infer.text  # still serving, as it was
    assert infer.json()["outputs"][0]["data"] == [2, 4]


def test_over_grpc_too(explicit: Stack, secret_file: Path) -> None:
    with grpc.insecure_channel(explicit.grpc_address) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        for config, field in (
            (_with_labels(str(secret_file)), "label_filename"),
            (_config(default_model_filename=str(secret_file)), "default_model_filename"),
        ):
            request = service_pb2.RepositoryModelLoadRequest(model_name="double")
            request.parameters["config"].string_param = json.dumps(config)
            request.parameters["file:1/model.py"].bytes_param = DOUBLE_MODEL.encode()
            with pytest.raises(grpc.RpcError) as failure:
                stub.RepositoryModelLoad(request, timeout=150)
            assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert field in str(failure.value.details())
            assert SECRET not in str(failure.value.details())


def test_labels_inside_the_model_still_load(explicit: Stack) -> None:
    """A ``label_filename`` in the model's folder (or a folder of it) is read as before."""
    config = _with_labels("labels/y.txt")
    parameters = {
        "config": json.dumps(config),
        "file:1/model.py": base64.b64encode(DOUBLE_MODEL.encode()).decode(),
        "file:labels/y.txt": base64.b64encode(b"low\nhigh\n").decode(),
    }
    url = f"{explicit.url}/v2/repository/models/double/load"
    answer = httpx.post(url, json={"parameters": parameters}, timeout=150)
    assert answer.status_code == 200, answer.text
    body = {
        "inputs": [{"name": "x", "shape": [2], "datatype": "FP32", "data": [1, 2]}],
        "outputs": [{"name": "y", "parameters": {"classification": 1}}],
    }
    infer = httpx.post(f"{explicit.url}/v2/models/double/infer", json=body, timeout=30)
    assert infer.status_code == 200, infer.text
    assert infer.json()["outputs"][0]["data"] == ["4.000000:1:high"]


def test_hostile_model_names_are_refused(explicit: Stack) -> None:
    """A name that is not one folder of the repository is refused before anything is staged
    (over HTTP, percent-encoded; over gRPC, as it is)."""
    body = {"parameters": {"config": json.dumps(_config())}}
    for quoted in ("%2E%2E", ".hidden", "a%0Ab", "a%00b", "x" * 300):
        answer = httpx.post(
            f"{explicit.url}/v2/repository/models/{quoted}/load", json=body, timeout=150
        )
        assert answer.status_code in (400, 404), (quoted, answer.text)
        if answer.status_code == 400:
            assert "invalid model name" in answer.json()["error"], answer.text
    with grpc.insecure_channel(explicit.grpc_address) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        for name in ("../escape", "/etc", "..", "a\0b", "a\\b"):
            request = service_pb2.RepositoryModelLoadRequest(model_name=name)
            request.parameters["config"].string_param = json.dumps(_config())
            request.parameters["file:1/model.py"].bytes_param = DOUBLE_MODEL.encode()
            with pytest.raises(grpc.RpcError) as failure:
                stub.RepositoryModelLoad(request, timeout=150)
            assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT, name
            assert "invalid model name" in str(failure.value.details()), name
    assert not (Path(explicit.repository).parent / "escape").exists()
