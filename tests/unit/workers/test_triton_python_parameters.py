"""A Triton Python model's request and response parameters as the worker's execution hands
them over, for a batch of real stream entries: each request's response parameters stay
with that request (a response that is no InferenceResponse moves none of the others'), and
what the reply entry cannot carry is refused where the model makes it."""

from __future__ import annotations

import itertools
import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sluice.core.config import ModelConfig
from sluice.core.datatypes import to_buffer
from sluice.core.errors import SluiceError
from sluice.core.placement import Placement
from sluice.core.repository import read_model
from sluice.core.wire import ReplyMessage, RequestMessage, TensorHeader, encode_reply
from sluice.workers.backends import load_backend
from sluice.workers.backends.base import Backend
from sluice.workers.execution import Execution
from sluice.workers.replies import Timing
from sluice.workers.tensors import PendingRequest
from tests.support.model_files import python_config, tensor, write_model

TAGGER = """
import json
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            tag = int(x[0, 0])
            if tag == 0:
                responses.append(None)  # (not an InferenceResponse: this request fails)
                continue
            own = json.loads(request.parameters())
            responses.append(
                pb_utils.InferenceResponse(
                    [pb_utils.Tensor("Y", x)], parameters={"tag": tag, "own": json.dumps(own)}
                )
            )
        return responses
"""
"""Answers each request with its tag (its input's value) as a response parameter; tag 0
returns None instead of a response."""

CONFIG = python_config([tensor("X", "TYPE_FP32", "1")], [tensor("Y", "TYPE_FP32", "1")])
CPU = Placement("KIND_CPU", None, 1)
_ENTRIES = itertools.count(1)


@pytest.fixture
def tagger(tmp_path: Path) -> Iterator[tuple[ModelConfig, Backend]]:
    model_dir = write_model(tmp_path, "tagger", CONFIG, {"1/model.py": TAGGER})
    found = read_model(model_dir)
    assert found.config is not None, found.error
    backend = load_backend(found.config, found.model_file(1), CPU)
    yield found.config, backend
    backend.close()


def _request(tag: float, **parameters: Any) -> PendingRequest:
    x = np.full((1, 1), tag, np.float32)
    data = to_buffer("FP32", x)
    message = RequestMessage(
        request_key=uuid.uuid4().hex,
        reply_to="",
        inputs=[TensorHeader("X", "FP32", (1, 1), len(data))],
        outputs=["Y"],
        parameters=parameters,
    )
    entry_id = f"{next(_ENTRIES)}-0".encode()
    return PendingRequest(entry_id, message, memoryview(bytes(data)), 1, ())


def test_each_request_keeps_its_own_response_parameters(
    tagger: tuple[ModelConfig, Backend],
) -> None:
    config, backend = tagger
    batch = [_request(0), _request(1, secret="one"), _request(2, secret="two")]
    timing = Timing()
    answers = Execution(config, 1).compute(batch, backend, timing)
    assert isinstance(answers[0], SluiceError)
    assert not isinstance(answers[1], SluiceError) and not isinstance(answers[2], SluiceError)
    # The failed request carries none; the others carry their own, not their neighbour's.
    assert batch[0].entry_id not in timing.response_parameters
    one = timing.response_parameters[batch[1].entry_id]
    two = timing.response_parameters[batch[2].entry_id]
    assert one["tag"] == 1 and json.loads(one["own"]) == {"secret": "one"}
    assert two["tag"] == 2 and json.loads(two["own"]) == {"secret": "two"}


WIDE = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [
            pb_utils.InferenceResponse(
                [pb_utils.get_input_tensor_by_name(r, "X")], parameters={"n": 1 << 64}
            )
            for r in requests
        ]
"""


def test_a_response_parameter_beyond_64_bits_fails_the_model_not_the_reply(
    tmp_path: Path,
) -> None:
    """Taken as it was, it reached the reply entry, which msgpack cannot encode: the publish
    of the whole batch's answers raised, and none of its requests was answered."""
    model_dir = write_model(tmp_path, "wide", CONFIG, {"1/model.py": WIDE})
    found = read_model(model_dir)
    assert found.config is not None, found.error
    backend = load_backend(found.config, found.model_file(1), CPU)
    batch = [_request(1)]
    timing = Timing()
    try:
        with pytest.raises(SluiceError, match="64-bit"):
            answers = Execution(found.config, 1).compute(batch, backend, timing)
            for request, answer in zip(batch, answers, strict=True):
                parameters = timing.response_parameters.get(request.entry_id, {})
                assert not isinstance(answer, SluiceError)
                encode_reply(
                    ReplyMessage(request.message.request_key, 1, answer[0], parameters=parameters)
                )
    finally:
        backend.close()
