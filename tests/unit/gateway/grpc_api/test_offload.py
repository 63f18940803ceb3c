"""Which gRPC requests are decoded and parsed on a thread, told before decoding them: those
whose elements are many (typed contents, BYTES tensors, many fields), not only large ones;
the small raw request of the hot path stays on the event loop. Nothing is timed."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from tritonclient.grpc import service_pb2

from sluice.core.errors import InvalidInput
from sluice.gateway.grpc_api import infer
from sluice.gateway.grpc_api.infer import InferCalls
from sluice.gateway.grpc_api.offload import FIELDS_ON_LOOP, SHORT_BYTES, decoded_on_thread
from sluice.gateway.inference.data_plane import OFFLOAD_BYTES, PARSED_ON_LOOP_BYTES
from sluice.gateway.inference.queue_turn import QueueTurn
from sluice.gateway.inference.request import DEFAULT_LIMITS

_ELEMENTS_PAST_THE_LIMIT = PARSED_ON_LOOP_BYTES + 16
"""Elements enough for typed contents of any kind (one byte each at least) to pass the limit."""


def _request(datatype: str = "FP32", count: int = 64) -> Any:
    request = service_pb2.ModelInferRequest(model_name="m", id="r")
    request.inputs.add(name="x", datatype=datatype, shape=[count])
    return request


def _raw(datatype: str, data: bytes, inputs: int = 1) -> bytes:
    request = _request(datatype)
    for index in range(1, inputs):
        request.inputs.add(name=f"x{index}", datatype=datatype, shape=[1])
    request.raw_input_contents.extend([data] * inputs)
    return bytes(request.SerializeToString())


def _typed(field: str, datatype: str, values: Any) -> bytes:
    request = _request(datatype, len(values))
    getattr(request.inputs[0].contents, field).extend(values)
    return bytes(request.SerializeToString())


def test_raw_tensors_stay_on_the_loop_up_to_the_offload_size() -> None:
    assert not decoded_on_thread(_raw("FP32", bytes(4 * 64)))  # (mlp's request)
    almost = _raw("FP32", bytes(OFFLOAD_BYTES - 1024))
    assert PARSED_ON_LOOP_BYTES < len(almost) <= OFFLOAD_BYTES
    assert not decoded_on_thread(almost)
    assert not decoded_on_thread(_raw("FP32", bytes(1024), inputs=8))
    assert decoded_on_thread(_raw("FP32", bytes(OFFLOAD_BYTES)))


@pytest.mark.parametrize(
    ("field", "datatype", "dtype"),
    [
        ("bool_contents", "BOOL", np.bool_),
        ("int_contents", "INT32", np.int32),
        ("int_contents", "INT8", np.int32),
        ("int64_contents", "INT64", np.int64),
        ("uint_contents", "UINT32", np.uint32),
        ("uint64_contents", "UINT64", np.uint64),
        ("fp32_contents", "FP32", np.float32),
        ("fp64_contents", "FP64", np.float64),
    ],
)
def test_typed_contents_past_the_limit_go_to_a_thread(
    field: str, datatype: str, dtype: Any
) -> None:
    """Each value of typed contents is read one by one: far fewer bytes than a raw tensor's
    may hold the loop for milliseconds."""
    few = _typed(field, datatype, np.zeros(64, dtype))
    assert not decoded_on_thread(few)
    many = _typed(field, datatype, np.zeros(_ELEMENTS_PAST_THE_LIMIT, dtype))
    assert PARSED_ON_LOOP_BYTES < len(many) < OFFLOAD_BYTES
    assert decoded_on_thread(many)


def test_bytes_elements_past_the_limit_go_to_a_thread() -> None:
    """bytes_contents are length-prefixed one by one; BYTES in raw_input_contents are
    counted one by one: past the limit, on a thread (even empty strings, two bytes each)."""
    assert not decoded_on_thread(_typed("bytes_contents", "BYTES", [b""] * 64))
    empty = _typed("bytes_contents", "BYTES", [b""] * (PARSED_ON_LOOP_BYTES // 2 + 8))
    assert len(empty) < OFFLOAD_BYTES
    assert decoded_on_thread(empty)
    assert not decoded_on_thread(_raw("BYTES", bytes(PARSED_ON_LOOP_BYTES // 2)))
    assert decoded_on_thread(_raw("BYTES", bytes(PARSED_ON_LOOP_BYTES + 4)))


def test_a_message_of_many_fields_goes_to_a_thread() -> None:
    """Telling walks a bounded number of fields: past them, the message is not walked on."""
    request = _request()
    for index in range(FIELDS_ON_LOOP):
        request.outputs.add(name=f"o{index}" + "_" * 200)
    message = bytes(request.SerializeToString())
    assert PARSED_ON_LOOP_BYTES < len(message) < OFFLOAD_BYTES
    assert decoded_on_thread(message)


async def _placed(monkeypatch: pytest.MonkeyPatch, message: bytes) -> tuple[bool, bool]:
    """For a stream's request: whether it was decoded on a thread, and whether its parse was
    asked to run on one (``prepare_with``'s ``heavy``)."""
    decoded_elsewhere: list[bool] = []
    heavy: list[bool] = []
    decode = infer._decode

    def recording_decode(message: bytes, limits: Any) -> Any:
        decoded_elsewhere.append(threading.current_thread() is not threading.main_thread())
        return decode(message, limits)

    async def prepare_with(*args: Any, **kwargs: Any) -> None:
        heavy.append(args[4])
        raise InvalidInput("stop here")

    monkeypatch.setattr(infer, "_decode", recording_decode)
    monkeypatch.setattr(infer, "prepare_with", prepare_with)
    settings = SimpleNamespace(grpc_header_forward_pattern="")
    state = SimpleNamespace(settings=settings, limits=DEFAULT_LIMITS, tracing=None)
    calls = InferCalls(state, SimpleNamespace(concurrent_receives=1))  # type: ignore[arg-type]

    async def sink(_: bytes) -> None:
        raise AssertionError("no answer expected")

    answer = await calls._stream_answer(message, {}, sink, QueueTurn(None))
    assert b"stop here" in answer
    return decoded_elsewhere[0], heavy[0]


async def test_the_calls_decode_and_parse_where_the_rule_says(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert threading.current_thread() is threading.main_thread()
    small = _raw("FP32", bytes(4 * 64))
    assert await _placed(monkeypatch, small) == (False, False)
    typed = _typed("fp32_contents", "FP32", np.zeros(_ELEMENTS_PAST_THE_LIMIT, np.float32))
    assert await _placed(monkeypatch, typed) == (True, True)


def test_a_short_message_of_many_entries_goes_to_a_thread_to_be_counted() -> None:
    # 2,048 empty outputs in 4 KiB: counting them before decoding walks 2,048 fields (4.5 ms
    # of the loop on this machine), so a message with more fields than FIELDS_ON_LOOP goes
    # to a thread however short; one of SHORT_BYTES or less is not looked at.
    assert decoded_on_thread(b"\x32\x00" * 2048)
    assert decoded_on_thread(b"\x32\x00" * (SHORT_BYTES // 2 + 1))
    assert not decoded_on_thread(b"\x32\x00" * (SHORT_BYTES // 2))
