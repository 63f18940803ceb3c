"""Where a batch computes: on the worker's event loop when the backend allows it and the
cost model expects the batch to be short (a thread hand-off costs more than a tiny model's
run), else on the compute thread; a long batch, a backend that may call back into the loop
and a model not yet measured always go to the thread."""

from __future__ import annotations

import asyncio
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

from sluice.core.config import parse_config_text
from sluice.core.datatypes import to_buffer
from sluice.core.wire import RequestMessage, TensorHeader
from sluice.workers.adaptive import BatchPolicy, CostModel
from sluice.workers.execution import INLINE_MAX_S, Execution
from sluice.workers.tensors import PendingRequest

CONFIG = """
max_batch_size: 8
input [ { name: "IN" data_type: TYPE_FP32 dims: [ 2 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 2 ] } ]
"""


class _Publisher:
    async def started(self, requests: list[PendingRequest]) -> None:
        del requests


class _Doubling:
    """Answers OUT = 2 IN, and notes the thread it ran on."""

    def __init__(self, computes_inline: bool) -> None:
        self.computes_inline = computes_inline
        self.threads: list[int] = []

    def infer(self, inputs: Any, outputs: Any, request_sizes: Any = None) -> dict[str, Any]:
        self.threads.append(threading.get_ident())
        return {"OUT": inputs["IN"] * 2}

    def close(self) -> None:
        pass


def _request() -> PendingRequest:
    x = np.ones((1, 2), np.float32)
    data = to_buffer("FP32", x)
    message = RequestMessage(
        request_key=uuid.uuid4().hex,
        reply_to="",
        inputs=[TensorHeader("IN", "FP32", (1, 2), len(data))],
        outputs=["OUT"],
    )
    return PendingRequest(b"1-0", message, memoryview(bytes(data)), 1, ())


def _policy(batch_seconds: float | None) -> BatchPolicy:
    """A policy whose cost model has seen enough batches of ``batch_seconds`` (None: none)."""
    cost = CostModel()
    for _ in range(0 if batch_seconds is None else 16):
        assert batch_seconds is not None
        cost.observe(1, batch_seconds)
    return BatchPolicy(0.0, False, cost=cost)


@pytest.mark.parametrize(
    ("computes_inline", "batch_seconds", "on_loop"),
    [
        (True, INLINE_MAX_S / 10, True),
        (True, INLINE_MAX_S * 4, False),  # long enough to hold the loop up: the thread
        (True, None, False),  # not measured yet
        (False, INLINE_MAX_S / 10, False),  # the backend may call back into the loop
    ],
)
def test_where_a_batch_computes(
    computes_inline: bool, batch_seconds: float | None, on_loop: bool
) -> None:
    backend = _Doubling(computes_inline)
    executor = ThreadPoolExecutor(1)
    execution = Execution(
        parse_config_text(CONFIG, model_name="m"),
        1,
        backend=backend,
        publisher=_Publisher(),  # type: ignore[arg-type]
        executor=executor,
        policy=_policy(batch_seconds),
    )

    async def compute() -> int:
        outcomes, _, items = await execution._compute_batch([_request(), _request()])
        assert [o.reply.error for o in outcomes] == ["", ""]
        assert items == 2
        return threading.get_ident()

    try:
        loop_thread = asyncio.run(compute())
    finally:
        executor.shutdown()
    assert len(backend.threads) == 1
    assert (backend.threads[0] == loop_thread) is on_loop


def test_the_onnxruntime_backend_computes_inline() -> None:
    from sluice.workers.backends.onnxruntime_backend import OnnxRuntimeBackend
    from sluice.workers.backends.triton_python import TritonPythonBackend

    assert OnnxRuntimeBackend.computes_inline is True
    assert getattr(TritonPythonBackend, "computes_inline", False) is False
