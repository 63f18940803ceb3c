"""What a model written for Triton's Python backend sees of each request, and what it may
leave out, computed by the worker's execution as a batch of real stream entries:
``request.flags()`` and ``request.correlation_id()`` carry the sequence flags and id
(integer or string), in a decoupled model's streams too; a response without an output its
request asked for answers without it (per request, in a batch of several); an ensemble's
answers carry Triton's sequence parameters, and a bad one refuses the request naming it."""

from __future__ import annotations

import asyncio
import itertools
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sluice.core.config import ModelConfig, parse_config_text
from sluice.core.datatypes import to_buffer
from sluice.core.errors import InvalidInput
from sluice.core.placement import Placement
from sluice.core.repository import read_model
from sluice.core.sequences import ensemble_response_parameters, request_sequence
from sluice.core.wire import RequestMessage, TensorHeader, decode_reply, encode_reply
from sluice.workers.backends import load_backend
from sluice.workers.backends.base import Backend, PartialOutputs
from sluice.workers.execution import Execution
from sluice.workers.replies import Outcome, Timing
from sluice.workers.tensors import PendingRequest
from tests.support.model_files import python_config, tensor, write_model

SEQUENCE_AWARE = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            rows = x.shape[0]
            cid = request.correlation_id()
            outputs = [
                pb_utils.Tensor("FLAGS", np.full((rows, 1), request.flags(), np.int32)),
                pb_utils.Tensor("CID", np.array([[str(cid).encode()]] * rows, dtype=object)),
                pb_utils.Tensor("CID_IS_INT", np.full((rows, 1), isinstance(cid, int))),
            ]
            if request.flags() & pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START:
                outputs.append(pb_utils.Tensor("ONLY_AT_START", x * 2))
            responses.append(pb_utils.InferenceResponse(outputs))
        return responses
"""

CONFIG = python_config(
    [tensor("X", "TYPE_FP32", "2")],
    [
        tensor("FLAGS", "TYPE_INT32", "1"),
        tensor("CID", "TYPE_STRING", "1"),
        tensor("CID_IS_INT", "TYPE_BOOL", "1"),
        tensor("ONLY_AT_START", "TYPE_FP32", "2"),
    ],
)
CPU = Placement("KIND_CPU", None, 1)
_ENTRIES = itertools.count(1)


@pytest.fixture
def model(tmp_path: Path) -> Iterator[tuple[ModelConfig, Backend]]:
    model_dir = write_model(tmp_path, "aware", CONFIG, {"1/model.py": SEQUENCE_AWARE})
    found = read_model(model_dir)
    assert found.config is not None, found.error
    backend = load_backend(found.config, found.model_file(1), CPU)
    yield found.config, backend
    backend.close()


def _request(
    x: np.ndarray, outputs: list[str], name: str = "X", **parameters: Any
) -> PendingRequest:
    data = to_buffer("FP32", x)
    message = RequestMessage(
        request_key=uuid.uuid4().hex,
        reply_to="",
        inputs=[TensorHeader(name, "FP32", tuple(x.shape), len(data))],
        outputs=outputs,
        parameters=parameters,
    )
    entry_id = f"{next(_ENTRIES)}-0".encode()
    return PendingRequest(entry_id, message, memoryview(bytes(data)), x.shape[0], ())


def _names(answer: Any) -> list[str]:
    headers, _ = answer
    return [header.name for header in headers]


def test_flags_and_correlation_id_reach_the_model(model: tuple[ModelConfig, Backend]) -> None:
    config, backend = model
    x = np.ones((1, 2), np.float32)
    batch = [
        _request(x, ["FLAGS", "CID", "CID_IS_INT"], sequence_id=42, sequence_start=True),
        _request(x, ["FLAGS", "CID", "CID_IS_INT"], sequence_id="user-7", sequence_end=True),
        _request(x, ["FLAGS", "CID"]),
        _request(x, ["FLAGS"], sequence_id=5, sequence_start=True, sequence_end=True),
    ]
    outputs = backend.infer(  # type: ignore[call-arg]
        {"X": np.concatenate([x] * 4)},
        ["FLAGS", "CID", "CID_IS_INT"],
        request_sizes=[1, 1, 1, 1],
        sequences=[request_sequence(r.message.parameters) for r in batch],
    )
    assert outputs["FLAGS"].ravel().tolist() == [1, 2, 0, 3]
    assert outputs["CID"].ravel().tolist() == [b"42", b"user-7", b"0", b"5"]
    assert outputs["CID_IS_INT"].ravel().tolist() == [True, False, True, True]
    # The worker's execution hands them over the same way.
    answers = Execution(config, 1).compute(batch, backend, Timing())
    assert [_names(answer) for answer in answers] == [
        ["FLAGS", "CID", "CID_IS_INT"],
        ["FLAGS", "CID", "CID_IS_INT"],
        ["FLAGS", "CID"],
        ["FLAGS"],
    ]


STREAMING_SEQUENCE_AWARE = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            flags = np.full((1, 1), request.flags(), np.int32)
            cid = np.array([[str(request.correlation_id()).encode()]], dtype=object)
            sender.send(
                pb_utils.InferenceResponse(
                    [pb_utils.Tensor("FLAGS", flags), pb_utils.Tensor("CID", cid)]
                )
            )
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""


def test_a_decoupled_model_sees_flags_and_correlation_id_too(tmp_path: Path) -> None:
    config_text = python_config(
        [tensor("X", "TYPE_FP32", "2")],
        [tensor("FLAGS", "TYPE_INT32", "1"), tensor("CID", "TYPE_STRING", "1")],
        extra="model_transaction_policy { decoupled: true }",
    )
    model_dir = write_model(
        tmp_path, "streaming", config_text, {"1/model.py": STREAMING_SEQUENCE_AWARE}
    )
    found = read_model(model_dir)
    assert found.config is not None and found.config.decoupled, found.error
    backend = load_backend(found.config, found.model_file(1), CPU)
    sent: list[tuple[str, bytes]] = []
    try:
        x = np.ones((1, 2), np.float32)
        batch = [
            _request(x, ["FLAGS", "CID"], sequence_id=42, sequence_start=True),
            _request(x, ["FLAGS", "CID"], sequence_id="user-7", sequence_end=True),
        ]

        def send_partial(request: PendingRequest, reply: Any, payload: bytes) -> None:
            sent.append((request.message.request_key, payload))

        execution = Execution(found.config, 1, send_partial=send_partial)
        finals = execution.compute(batch, backend, Timing())
    finally:
        backend.close()
    assert [answer for answer in finals if not isinstance(answer, tuple)] == []
    by_request = dict(sent)
    first, second = (by_request[r.message.request_key] for r in batch)
    # (each payload: the FLAGS int32, then the CID string, length-prefixed)
    assert np.frombuffer(first[:4], np.int32).tolist() == [1] and first.endswith(b"42")
    assert np.frombuffer(second[:4], np.int32).tolist() == [2] and second.endswith(b"user-7")


def test_an_output_a_response_lacks_is_left_out_of_that_answer_only(
    model: tuple[ModelConfig, Backend],
) -> None:
    config, backend = model
    x = np.arange(6, dtype=np.float32).reshape(3, 2)
    wanted = ["FLAGS", "ONLY_AT_START"]
    batch = [
        _request(x[:1], wanted, sequence_id=1, sequence_start=True),
        _request(x[1:], wanted, sequence_id=2),
    ]
    outputs = backend.infer(  # type: ignore[call-arg]
        {"X": x}, wanted, request_sizes=[1, 2], sequences=[(1, 1), (2, 0)]
    )
    assert isinstance(outputs, PartialOutputs)
    assert outputs.absent == {1: frozenset({"ONLY_AT_START"})}
    np.testing.assert_array_equal(outputs["ONLY_AT_START"][:1], x[:1] * 2)
    answers = Execution(config, 1).compute(batch, backend, Timing())
    assert [_names(answer) for answer in answers] == [["FLAGS", "ONLY_AT_START"], ["FLAGS"]]
    # A lone request whose response lacks it: answered without it (Triton: 200, no output).
    (alone,) = Execution(config, 1).compute([_request(x[1:], wanted)], backend, Timing())
    assert _names(alone) == ["FLAGS"]


def test_ensemble_response_parameters_are_tritons() -> None:
    assert ensemble_response_parameters({}) == {
        "sequence_id": 0,
        "sequence_start": False,
        "sequence_end": False,
    }
    assert ensemble_response_parameters(
        {"sequence_id": "abc", "sequence_start": True, "other": 1}
    ) == {"sequence_id": "abc", "sequence_start": True, "sequence_end": False}
    # An unsigned id above the int64 range is written as Triton writes it (signed).
    assert (
        ensemble_response_parameters({"sequence_id": (1 << 64) - 1, "sequence_end": True})[
            "sequence_id"
        ]
        == -1
    )
    for parameters, message in [
        ({"sequence_start": "yes"}, "parameter 'sequence_start' must be a boolean"),
        ({"sequence_end": 1}, "parameter 'sequence_end' must be a boolean"),
        ({"sequence_id": 1.5}, "parameter 'sequence_id' must be an unsigned integer or a string"),
        ({"sequence_id": -3}, "parameter 'sequence_id' must be an unsigned 64-bit integer"),
    ]:
        with pytest.raises(InvalidInput, match=message):
            ensemble_response_parameters(parameters)


ENSEMBLE = """
name: "ens"
platform: "ensemble"
max_batch_size: 4
input [ { name: "IN" data_type: TYPE_FP32 dims: [ 2 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 2 ] } ]
ensemble_scheduling { step [ { model_name: "m" model_version: -1
  input_map { key: "X" value: "IN" } output_map { key: "Y" value: "OUT" } } ] }
"""


class _Publisher:
    def __init__(self) -> None:
        self.outcomes: list[Outcome] = []

    async def started(self, requests: list[PendingRequest]) -> None:
        del requests


class _Echo:
    """An ensemble's stand-in: answers OUT = IN."""

    concurrency = 1

    def infer(self, inputs: Any, outputs: Any, request_sizes: Any = None) -> dict[str, Any]:
        return {"OUT": inputs["IN"]}

    def close(self) -> None:
        pass


def test_an_ensembles_answers_carry_the_sequence_parameters() -> None:
    config = parse_config_text(ENSEMBLE, model_name="ens")
    execution = Execution(config, 1, backend=_Echo(), publisher=_Publisher())  # type: ignore[arg-type]
    x = np.ones((1, 2), np.float32)
    plain = _request(x, ["OUT"], "IN")
    flagged = _request(x, ["OUT"], "IN", sequence_id="s-1", sequence_end=True)
    broken = _request(x, ["OUT"], "IN", sequence_start="true")
    outcomes, _, _ = asyncio.run(execution._compute_batch([plain, flagged, broken]))
    by_key = {outcome.request.message.request_key: outcome.reply for outcome in outcomes}
    assert by_key[plain.message.request_key].parameters == {
        "sequence_id": 0,
        "sequence_start": False,
        "sequence_end": False,
    }
    assert by_key[flagged.message.request_key].parameters == {
        "sequence_id": "s-1",
        "sequence_start": False,
        "sequence_end": True,
    }
    refused = by_key[broken.message.request_key]
    assert refused.error_kind == "InvalidInput"
    assert refused.error == "parameter 'sequence_start' must be a boolean"
    # The parameters travel in the reply entry to the gateway.
    sent = next(o for o in outcomes if o.request is flagged)
    reply, _ = decode_reply(encode_reply(sent.reply, sent.payload))
    assert reply.parameters == {"sequence_id": "s-1", "sequence_start": False, "sequence_end": True}
    assert decode_reply(encode_reply(by_key[refused.request_key]))[0].parameters == {}
