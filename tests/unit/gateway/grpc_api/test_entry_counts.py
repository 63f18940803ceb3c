"""A ModelInferRequest's entries counted before it is decoded."""

from __future__ import annotations

import pytest
from tritonclient.grpc import service_pb2

from sluice.core.errors import InvalidInput
from sluice.gateway.grpc_api.entry_counts import MAX_OUTPUTS, check_entry_counts
from sluice.gateway.inference.request import DEFAULT_LIMITS

LIMITS = DEFAULT_LIMITS


def _message(inputs: int = 1, outputs: int = 0, parameters: int = 0) -> bytes:
    request = service_pb2.ModelInferRequest(model_name="m", model_version="1", id="r")
    for index in range(inputs):
        request.inputs.add(name=f"I{index}", datatype="FP32", shape=[1])
        request.raw_input_contents.append(b"\x00" * 4)
    for index in range(outputs):
        request.outputs.add(name=f"O{index}")
    for index in range(parameters):
        request.parameters[f"p{index}"].int64_param = index
    return bytes(request.SerializeToString())


def test_a_request_within_the_limits_passes() -> None:
    check_entry_counts(_message(LIMITS.max_inputs, MAX_OUTPUTS, LIMITS.max_parameters), LIMITS)
    check_entry_counts(b"", LIMITS)


@pytest.mark.parametrize(
    ("message", "text"),
    [
        (
            _message(inputs=LIMITS.max_inputs + 1),
            "request 'inputs' has more entries than the limit of 256",
        ),
        (
            _message(outputs=MAX_OUTPUTS + 1),
            "request 'outputs' has more entries than the limit of 4096",
        ),
        (_message(parameters=LIMITS.max_parameters + 1), "request 'parameters' has more entries"),
        (_message() + b"\x1a\x00" * 10_000, "the ModelInferRequest has more than"),
    ],
)
def test_a_request_past_them_is_refused(message: bytes, text: str) -> None:
    with pytest.raises(InvalidInput, match=f"^{text}"):
        check_entry_counts(message, LIMITS)


@pytest.mark.parametrize("message", [b"\xff", b"\x2a\xff\xff", b"\x0b\x00", b"\x2a\x05ab"])
def test_what_is_malformed_is_left_to_the_decoder(message: bytes) -> None:
    check_entry_counts(message, LIMITS)


def test_a_message_too_short_to_pass_any_bound_is_not_walked() -> None:
    # Every field takes two bytes or more, so a message shorter than twice the smallest
    # bound (plus one) cannot pass it: such messages (most requests) cost one comparison.
    short = b"\x2a\x00" * LIMITS.max_inputs
    check_entry_counts(short, LIMITS)
    with pytest.raises(InvalidInput, match="'inputs' has more entries"):
        check_entry_counts(short + b"\x2a\x00", LIMITS)
