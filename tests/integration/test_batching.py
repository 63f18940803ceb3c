"""Concurrent clients on one model are served in micro-batches, each answer to its own request."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import tritonclient.http as httpclient

from tests.support.onnx_models import ALL_DATATYPES
from tests.support.stack import Stack

CLIENTS = 32
REQUESTS_PER_CLIENT = 4
DATATYPES = [dt for dt in ALL_DATATYPES if dt != "BF16"]


def _request(
    client_index: int, request_index: int
) -> tuple[list[httpclient.InferInput], np.ndarray]:
    """Every input carries a value unique to this request, so a mixed-up answer shows."""
    marker = np.array([[client_index * 1000 + request_index]], dtype=np.int64)
    inputs = []
    for datatype in DATATYPES:
        tensor = httpclient.InferInput(f"IN_{datatype}", [1, 1], datatype)
        if datatype == "INT64":
            tensor.set_data_from_numpy(marker)
        elif datatype == "BYTES":
            tensor.set_data_from_numpy(np.array([[str(marker[0, 0]).encode()]], dtype=np.object_))
        elif datatype == "BOOL":
            tensor.set_data_from_numpy(np.array([[True]]))
        else:
            tensor.set_data_from_numpy(np.ones((1, 1), dtype=tensor_dtype(datatype)))
        inputs.append(tensor)
    return inputs, marker


def tensor_dtype(datatype: str) -> type:
    from tritonclient.utils import triton_to_np_dtype

    return triton_to_np_dtype(datatype)


def _client(stack: Stack, client_index: int) -> list[bool]:
    results = []
    with httpclient.InferenceServerClient(stack.address) as client:
        for request_index in range(REQUESTS_PER_CLIENT):
            inputs, marker = _request(client_index, request_index)
            outputs = [
                httpclient.InferRequestedOutput("OUT_INT64"),
                httpclient.InferRequestedOutput("OUT_BYTES"),
            ]
            result = client.infer("identity", inputs, outputs=outputs, request_id=str(marker[0, 0]))
            results.append(
                result.get_response()["id"] == str(marker[0, 0])
                and np.array_equal(result.as_numpy("OUT_INT64"), marker)
                and result.as_numpy("OUT_BYTES")[0, 0] == str(marker[0, 0]).encode()
            )
    return results


def test_concurrent_clients_are_batched_and_answered_correctly(stack: Stack) -> None:
    with httpclient.InferenceServerClient(stack.address) as client:
        before = client.get_inference_statistics("identity")["model_stats"][0]
    with ThreadPoolExecutor(CLIENTS) as pool:
        outcomes = [
            ok for batch in pool.map(lambda i: _client(stack, i), range(CLIENTS)) for ok in batch
        ]
    assert len(outcomes) == CLIENTS * REQUESTS_PER_CLIENT
    assert all(outcomes)
    with httpclient.InferenceServerClient(stack.address) as client:
        after = client.get_inference_statistics("identity")["model_stats"][0]
    inferences = after["inference_count"] - before["inference_count"]
    executions = after["execution_count"] - before["execution_count"]
    assert inferences == CLIENTS * REQUESTS_PER_CLIENT
    assert executions <= inferences / 2, f"{executions} executions for {inferences} inferences"
    assert any(b["batch_size"] > 1 for b in after["batch_stats"])
