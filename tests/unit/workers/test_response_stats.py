"""Triton's ``response_stats`` for decoupled models: each response counted under its index
with how it ended, and rendered (JSON, and so gRPC) as Triton lays it out."""

from __future__ import annotations

from typing import Any

import numpy as np

from sluice.core.config import parse_config_text
from sluice.core.errors import Cancelled, InferenceFailed
from sluice.core.observability import statistics as st
from sluice.core.wire import ReplyMessage, RequestMessage
from sluice.workers.decoupled import compute_streaming
from sluice.workers.response_stats import ResponseTally
from sluice.workers.tensors import PendingRequest

CONFIG = parse_config_text(
    """
    name: "m"
    backend: "python"
    max_batch_size: 4
    input [ { name: "x" data_type: TYPE_FP32 dims: [ 1 ] } ]
    output [ { name: "y" data_type: TYPE_FP32 dims: [ 1 ] } ]
    model_transaction_policy { decoupled: true }
    """,
    model_name="m",
)


def _request(key: str) -> PendingRequest:
    return PendingRequest(b"0-1", RequestMessage(key, "r", [], ["y"]), memoryview(b""), 1, ())


class _Streamer:
    """Request 0: two responses, then the final flag alone; request 1: one response, then
    a failure; request 2: cancelled; request 3: one final response with outputs."""

    def infer_stream(self, inputs: Any, names: Any, sizes: Any, emit: Any) -> None:
        one = {"y": np.ones((1, 1), np.float32)}
        emit(0, one, False)
        emit(1, one, False)
        emit(0, one, False)
        emit(1, InferenceFailed("broke"), True)
        emit(2, Cancelled("gone"), True)
        emit(0, None, True)
        emit(3, one, True)
        emit(3, one, True)  # answered already: not counted


def test_each_response_is_counted_under_its_index_with_how_it_ended() -> None:
    tally = ResponseTally()
    sent: list[ReplyMessage] = []
    batch = [_request(k) for k in "abcd"]
    answers = compute_streaming(
        batch, {}, _Streamer(), CONFIG, 1, {}, lambda r, reply, p: sent.append(reply), tally=tally
    )
    assert [r.index for r in sent] == [0, 0, 1]
    assert answers[0] == ([], b"") and isinstance(answers[1], InferenceFailed)
    rendered = st.render_model_stats(
        "m", 1, {k.encode(): str(v).encode() for k, v in tally.counters.items()}, {}, {}
    )["response_stats"]
    counts = {
        index: {kind: d["count"] for kind, d in kinds.items() if d["count"]}
        for index, kinds in rendered.items()
    }
    made = {"compute_infer": 1, "compute_output": 1}
    assert counts == {
        # index 0: a's first, b's first, c's cancellation, d's final answer
        "0": {**{k: 4 for k in made}, "success": 3, "cancel": 1},
        # index 1: a's second, b's failure
        "1": {**{k: 2 for k in made}, "success": 1, "fail": 1},
        # index 2: a's final flag alone
        "2": {**made, "empty_response": 1},
    }
    for kinds in rendered.values():
        assert set(kinds) == set(st.RESPONSE_KINDS)
        outcome_ns = sum(kinds[k]["ns"] for k in st.RESPONSE_OUTCOMES)
        assert outcome_ns == kinds["compute_infer"]["ns"] + kinds["compute_output"]["ns"]


def test_indexes_past_the_bound_are_not_counted_and_odd_fields_are_skipped() -> None:
    tally = ResponseTally()
    tally.add(st.MAX_RESPONSE_INDEX, "success", 5, 1)
    tally.add(st.MAX_RESPONSE_INDEX + 1, "success", 5, 1)
    counters = {k.encode(): str(v).encode() for k, v in tally.counters.items()}
    counters[b"response.x.success.count"] = b"1"
    counters[b"response.1.bogus.count"] = b"1"
    rendered = st.render_model_stats("m", 1, counters, {}, {})["response_stats"]
    assert list(rendered) == [str(st.MAX_RESPONSE_INDEX)]
    assert rendered[str(st.MAX_RESPONSE_INDEX)]["success"] == {"count": 1, "ns": 6}
    assert st.render_model_stats("m", 1, {}, {}, {})["response_stats"] == {}
