"""Triton's --model-load-retry-count: a model whose loading fails the first time is served
after a retry (at start and on an explicit load request), and one that never loads fails
after as many attempts as allowed, with its own reason."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from sluice.scheduler.executor.redis_server import RedisServer
from tests.support.model_files import python_config, tensor, write_model
from tests.support.stack import Stack

# Counts its loads in the file the configuration names; fails while they are fewer than
# the configuration's "fail_first".
COUNTED = """
import json
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        parameters = json.loads(args["model_config"])["parameters"]
        tries = parameters["tries"]["string_value"]
        with open(tries, "a") as out:
            out.write("x")
        with open(tries) as seen:
            count = len(seen.read())
        if count <= int(parameters["fail_first"]["string_value"]):
            raise pb_utils.TritonModelException(f"load {count} failed on purpose")

    def execute(self, requests):
        return [
            pb_utils.InferenceResponse(
                [pb_utils.Tensor("Y", pb_utils.get_input_tensor_by_name(r, "X").as_numpy())]
            )
            for r in requests
        ]
"""


def _counted(root: Path, name: str, fail_first: int) -> Path:
    tries = root / f"{name}.tries"
    extra = (
        f'parameters {{ key: "tries" value {{ string_value: "{tries}" }} }}\n'
        f'parameters {{ key: "fail_first" value {{ string_value: "{fail_first}" }} }}'
    )
    config = python_config(
        [tensor("X", "TYPE_FP32", "1")], [tensor("Y", "TYPE_FP32", "1")], extra=extra
    )
    write_model(root / "repository", name, config, {"1/model.py": COUNTED})
    return tries


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("retry")


@pytest.fixture(scope="module")
def stack(root: Path, redis_server: RedisServer) -> Iterator[Stack]:
    _counted(root, "at_start", 1)
    args = [
        "--model-control-mode=explicit",
        "--load-model=at_start",
        "--model-load-retry-count=1",
        "--exit-on-error=true",
    ]
    started = Stack(root / "repository", redis_server.url, grpc_port=0, args=args)
    started.start()
    yield started
    started.stop()


def test_a_model_that_fails_its_first_load_at_start_is_served(root: Path, stack: Stack) -> None:
    with httpx.Client(base_url=stack.url, timeout=30) as http:
        assert http.get("/v2/models/at_start/ready").status_code == 200
        body = {"inputs": [{"name": "X", "datatype": "FP32", "shape": [1, 1], "data": [2.5]}]}
        answer = http.post("/v2/models/at_start/infer", json=body)
        assert answer.status_code == 200, answer.text
        assert answer.json()["outputs"][0]["data"] == [2.5]
    assert (root / "at_start.tries").read_text() == "xx"


def test_an_explicit_load_is_retried_and_a_hopeless_one_fails_with_its_reason(
    root: Path, stack: Stack
) -> None:
    flaky = _counted(root, "flaky", 1)
    hopeless = _counted(root, "hopeless", 1000)
    with httpx.Client(base_url=stack.url, timeout=120) as http:
        loaded = http.post("/v2/repository/models/flaky/load")
        assert loaded.status_code == 200, loaded.text
        assert http.get("/v2/models/flaky/ready").status_code == 200
        assert flaky.read_text() == "xx"

        refused = http.post("/v2/repository/models/hopeless/load")
        assert refused.status_code == 400, refused.text
        assert "load 2 failed on purpose" in refused.json()["error"], refused.text
        assert hopeless.read_text() == "xx"  # the first attempt and one retry
        assert http.get("/v2/models/hopeless/ready").status_code == 400
