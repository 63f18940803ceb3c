"""Triton's ragged batching on a real stack: three requests whose ragged input has 3, 4
and 5 elements share one batch (the model gets 12 elements and the running counts beside
them), and each client gets its own part of the output back, with its own shape, over
HTTP and through tritonclient."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import tritonclient.http as httpclient

from sluice.scheduler.executor.redis_server import RedisServer
from tests.support.onnx_models import write_ragged
from tests.support.stack import Stack

MODEL = "ragged"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer) -> Iterator[Stack]:
    repository = tmp_path_factory.mktemp("ragged")
    write_ragged(repository, MODEL, batch=3)
    stack = Stack(repository, redis_server.url, grpc_port=0)
    stack.start()
    yield stack
    stack.stop()


def infer(stack: Stack, values: list[float]) -> tuple[np.ndarray, np.ndarray]:
    client = httpclient.InferenceServerClient(stack.address)
    try:
        tensor = httpclient.InferInput("INPUT", [1, len(values)], "FP32")
        tensor.set_data_from_numpy(np.asarray([values], dtype=np.float32))
        result = client.infer(MODEL, [tensor])
        out, last = result.as_numpy("OUT"), result.as_numpy("LAST")
        assert out is not None and last is not None
        return out, last
    finally:
        client.close()


def test_requests_of_different_lengths_share_one_batch(stack: Stack) -> None:
    lengths = [3, 4, 5]
    inputs = [[float(10 * n + i) for i in range(n)] for n in lengths]
    with ThreadPoolExecutor(len(inputs)) as pool:  # (the batch closes at 3 requests)
        answers = list(pool.map(lambda values: infer(stack, values), inputs))
    for values, (out, _) in zip(inputs, answers, strict=True):
        assert out.shape == (1, len(values))
        assert out.tolist() == [[2 * v for v in values]]
    # One batch: in the batch's order, each request's running count is the one before it
    # plus its own length (separate batches would each count only their own).
    ordered = sorted(zip((float(last[0, 0]) for _, last in answers), lengths, strict=True))
    running = 0.0
    for last, length in ordered:
        running += length
        assert last == running, ordered
    stats = httpx.get(f"{stack.url}/v2/models/{MODEL}/stats").json()["model_stats"][0]
    assert stats["inference_count"] == 3 and stats["execution_count"] == 1, stats
