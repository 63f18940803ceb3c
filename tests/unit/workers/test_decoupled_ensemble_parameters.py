"""A decoupled ensemble's responses carry the request's sequence parameters, each of them,
as Triton's ensemble puts them on every response it sends (not only on its final one)."""

from __future__ import annotations

from typing import Any

import numpy as np

from sluice.core.config import parse_config_text
from sluice.core.wire import ReplyMessage, RequestMessage
from sluice.workers.execution import Execution
from sluice.workers.replies import Timing
from sluice.workers.tensors import PendingRequest

ENSEMBLE = parse_config_text(
    """
    name: "streaming"
    platform: "ensemble"
    max_batch_size: 0
    input [ { name: "text_input" data_type: TYPE_STRING dims: [ 1 ] } ]
    output [ { name: "y" data_type: TYPE_FP32 dims: [ 1 ] } ]
    model_transaction_policy { decoupled: true }
    ensemble_scheduling {
      step [ { model_name: "generator" model_version: -1
               input_map { key: "TEXT" value: "text_input" }
               output_map { key: "Y" value: "y" } } ]
    }
    """,
    model_name="streaming",
)


class _TwoResponses:
    """Each request: two responses, then the final flag alone."""

    def infer_stream(self, inputs: Any, names: Any, sizes: Any, emit: Any) -> None:
        for index in range(len(sizes)):
            emit(index, {"y": np.ones((1,), np.float32)}, False)
            emit(index, {"y": np.zeros((1,), np.float32)}, False)
            emit(index, None, True)


def _request(key: str, parameters: dict[str, Any]) -> PendingRequest:
    message = RequestMessage(key, "r", [], ["y"], parameters=parameters)
    return PendingRequest(key.encode(), message, memoryview(b""), 1, ())


def test_each_response_of_a_decoupled_ensemble_carries_the_sequence_parameters() -> None:
    assert ENSEMBLE.decoupled and ENSEMBLE.is_ensemble
    sent: list[ReplyMessage] = []
    batch = [
        _request("a", {"sequence_id": "order-1", "sequence_start": True}),
        _request("b", {}),
    ]
    backend: Any = _TwoResponses()
    execution = Execution(ENSEMBLE, 1, send_partial=lambda r, reply, p: sent.append(reply))
    execution.compute(batch, backend, Timing())
    assert [(reply.request_key, reply.parameters) for reply in sent] == [
        ("a", {"sequence_id": "order-1", "sequence_start": True, "sequence_end": False}),
        ("a", {"sequence_id": "order-1", "sequence_start": True, "sequence_end": False}),
        ("b", {"sequence_id": 0, "sequence_start": False, "sequence_end": False}),
        ("b", {"sequence_id": 0, "sequence_start": False, "sequence_end": False}),
    ]
