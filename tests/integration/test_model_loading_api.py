"""Triton's Python-backend model loading API (``pb_utils.is_model_ready``, ``load_model``,
``unload_model``) from a served model, in explicit model control: it loads and unloads
another model of the repository through the executor, a failed load is the model's error,
and a load from ``initialize`` is refused with the reason instead of waiting on itself."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from sluice.scheduler.executor.redis_server import RedisServer
from tests.support.model_files import python_config, tensor, write_model
from tests.support.onnx_models import write_identity
from tests.support.stack import Stack

LOADER = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            op = int(pb_utils.get_input_tensor_by_name(request, "OP").as_numpy().reshape(-1)[0])
            try:
                if op == 1:
                    pb_utils.load_model("ident")
                elif op == 2:
                    pb_utils.unload_model("ident")
                elif op == 3:
                    pb_utils.load_model("nope")
                ready = int(pb_utils.is_model_ready("ident"))
                ready_one = int(pb_utils.is_model_ready("ident", "1"))
                answer = np.array([[ready, ready_one]], dtype=np.int32)
                responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("READY", answer)]))
            except pb_utils.TritonModelException as exc:
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(exc))))
        return responses
"""

EAGER = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        pb_utils.load_model("ident")

    def execute(self, requests):
        return []
"""


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("loading")
    write_identity(root, "ident", ["FP32"])
    config = python_config([tensor("OP", "TYPE_INT32", "1")], [tensor("READY", "TYPE_INT32", "2")])
    write_model(root, "loader", config, {"1/model.py": LOADER})
    write_model(root, "eager", config, {"1/model.py": EAGER})
    started = Stack(
        root, redis_server.url, args=["--model-control-mode", "explicit", "--load-model", "loader"]
    )
    started.start()
    yield started
    started.stop()


def _ask(client: httpclient.InferenceServerClient, op: int) -> list[int]:
    request = httpclient.InferInput("OP", [1, 1], "INT32")
    request.set_data_from_numpy(np.array([[op]], dtype=np.int32))
    answer = client.infer("loader", [request])
    return [int(v) for v in answer.as_numpy("READY").reshape(-1)]


def test_a_model_loads_and_unloads_another(stack: Stack) -> None:
    client = httpclient.InferenceServerClient(stack.address, network_timeout=180)
    try:
        assert _ask(client, 0) == [0, 0]
        assert _ask(client, 1) == [1, 1]  # ready as soon as load_model returns
        assert client.is_model_ready("ident")
        assert _ask(client, 2) == [0, 0]
        assert not client.is_model_ready("ident")
        with pytest.raises(InferenceServerException) as info:
            _ask(client, 3)
        assert "failed to load 'nope'" in info.value.message()
    finally:
        client.close()


def test_a_load_from_initialize_is_refused_with_the_reason(stack: Stack) -> None:
    client = httpclient.InferenceServerClient(stack.address, network_timeout=180)
    try:
        with pytest.raises(InferenceServerException) as info:
            client.load_model("eager")
        assert "pb_utils.load_model('ident') cannot run in initialize" in info.value.message()
    finally:
        client.close()
