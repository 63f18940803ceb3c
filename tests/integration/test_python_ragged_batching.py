"""Ragged batching for a Triton Python model on a real stack (its worker a process of its
own): with ``allow_ragged_batch``, concurrent requests of different lengths reach one
``execute`` call, each ``InferenceRequest`` with its own shape, and each client gets its
own output shape back; a batch still holds at most ``max_batch_size`` items; without
``allow_ragged_batch`` requests of different lengths go to different calls. The model
answers, beside its output, what its ``execute`` call was given."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.http as httpclient

from sluice.scheduler.executor.redis_server import RedisServer
from tests.support.model_files import python_config, tensor, write_model
from tests.support.stack import Stack

RECORDING = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        xs = [pb_utils.get_input_tensor_by_name(r, "X").as_numpy() for r in requests]
        shapes = np.array([list(x.shape) for x in xs], np.int32)
        items = sum(x.shape[0] for x in xs)
        responses = []
        for x in xs:
            rows = x.shape[0]
            responses.append(
                pb_utils.InferenceResponse(
                    [
                        pb_utils.Tensor("Y", x * 2),
                        pb_utils.Tensor("CALLS", np.full((rows, 1), len(xs), np.int32)),
                        pb_utils.Tensor("ITEMS", np.full((rows, 1), items, np.int32)),
                        pb_utils.Tensor("SHAPES", np.stack([shapes] * rows)),
                    ]
                )
            )
        return responses
"""

OUTPUTS = [
    tensor("Y", "TYPE_FP32", "-1"),
    tensor("CALLS", "TYPE_INT32", "1"),
    tensor("ITEMS", "TYPE_INT32", "1"),
    tensor("SHAPES", "TYPE_INT32", "-1, 2"),
]
RAGGED, APART = "py_ragged", "py_apart"
BATCHING = """dynamic_batching {{ preferred_batch_size: [ 3 ]
                   max_queue_delay_microseconds: {delay} }}
parameters {{ key: "adaptive_batching" value {{ string_value: "false" }} }}"""


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer) -> Iterator[Stack]:
    repository = tmp_path_factory.mktemp("python_ragged")
    ragged_x = '{ name: "X" data_type: TYPE_FP32 dims: [ -1 ] allow_ragged_batch: true }'
    for name, x in ((RAGGED, ragged_x), (APART, tensor("X", "TYPE_FP32", "-1"))):
        # (a batch closes at 3 requests, or after the queue delay: 2 s)
        config = python_config(
            [x], OUTPUTS, max_batch_size=4, extra=BATCHING.format(delay=2_000_000)
        )
        write_model(repository, name, config, {"1/model.py": RECORDING})
    stack = Stack(Path(repository), redis_server.url, grpc_port=0)
    stack.start()
    yield stack
    stack.stop()


def infer(stack: Stack, model: str, x: np.ndarray) -> dict[str, np.ndarray]:
    client = httpclient.InferenceServerClient(stack.address)
    try:
        tensor = httpclient.InferInput("X", list(x.shape), "FP32")
        tensor.set_data_from_numpy(x)
        result = client.infer(model, [tensor])
        arrays = {name: result.as_numpy(name) for name in ("Y", "CALLS", "ITEMS", "SHAPES")}
        return {name: array for name, array in arrays.items() if array is not None}
    finally:
        client.close()


def concurrently(stack: Stack, model: str, xs: list[np.ndarray]) -> list[dict[str, np.ndarray]]:
    with ThreadPoolExecutor(len(xs)) as pool:
        return list(pool.map(lambda x: infer(stack, model, x), xs))


def executions(stack: Stack, model: str) -> int:
    stats = httpx.get(f"{stack.url}/v2/models/{model}/stats").json()["model_stats"][0]
    return int(stats["execution_count"])


def rows(lengths: list[int], items: int = 1) -> list[np.ndarray]:
    return [np.arange(items * n, dtype=np.float32).reshape(items, n) + 10 * n for n in lengths]


def test_requests_of_different_lengths_reach_one_execute_call(stack: Stack) -> None:
    before = executions(stack, RAGGED)
    xs = rows([3, 4, 5])
    answers = concurrently(stack, RAGGED, xs)
    for x, answer in zip(xs, answers, strict=True):
        np.testing.assert_array_equal(answer["Y"], x * 2)  # (its own shape back)
        assert answer["CALLS"].tolist() == [[3]]
        # (the call's requests, each with its own shape, in the batch's order)
        assert sorted(map(tuple, answer["SHAPES"][0].tolist())) == [(1, 3), (1, 4), (1, 5)]
    assert executions(stack, RAGGED) - before == 1


def test_a_ragged_batch_holds_at_most_max_batch_size_items(stack: Stack) -> None:
    """Requests of 2, 2 and 1 items (5, more than the 4 allowed) cannot share one call."""
    xs = [*rows([3, 4], items=2), *rows([5])]
    answers = concurrently(stack, RAGGED, xs)
    for x, answer in zip(xs, answers, strict=True):
        np.testing.assert_array_equal(answer["Y"], x * 2)
    assert max(int(answer["ITEMS"].max()) for answer in answers) <= 4


def test_without_allow_ragged_batch_different_lengths_go_to_different_calls(
    stack: Stack,
) -> None:
    before = executions(stack, APART)
    xs = rows([3, 4, 5])
    answers = concurrently(stack, APART, xs)
    for x, answer in zip(xs, answers, strict=True):
        np.testing.assert_array_equal(answer["Y"], x * 2)
        assert answer["CALLS"].tolist() == [[1]]
        assert answer["SHAPES"][0].tolist() == [list(x.shape)]
    assert executions(stack, APART) - before == 3
