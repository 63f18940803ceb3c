"""``sequence_batching`` parsed as Triton reads it, refused with the field and the reason,
and what a request says about its sequence (Triton's errors for what it lacks)."""

from __future__ import annotations

import numpy as np
import pytest

from sluice.core.config import parse_config_text
from sluice.core.errors import InvalidConfig, InvalidInput
from sluice.core.sequences import SequenceRef, sequence_of
from sluice.workers.sequence_book import _decode, _encode

BASE = """
name: "m"
max_batch_size: 4
input [ { name: "INPUT" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "OUTPUT" data_type: TYPE_FP32 dims: [ 1 ] } ]
"""


def _parse(sequence_batching: str, extra: str = ""):  # type: ignore[no-untyped-def]
    return parse_config_text(
        f"{BASE}{extra}\nsequence_batching {{ {sequence_batching} }}", model_name="m"
    )


def test_defaults_are_tritons() -> None:
    batching = _parse("").sequence_batching
    assert batching is not None
    assert (batching.strategy, batching.max_sequence_idle_us) == ("direct", 1_000_000)
    assert batching.controls == () and batching.states == ()


def test_controls_states_and_the_oldest_strategy() -> None:
    batching = _parse(
        """
        oldest {
          max_candidate_sequences: 4 preferred_batch_size: [ 2, 4 ]
          max_queue_delay_microseconds: 300
        }
        control_input [
          { name: "S" control [ { kind: CONTROL_SEQUENCE_START fp32_false_true: [ 0, 1 ] } ] },
          { name: "R"
            control [ { kind: CONTROL_SEQUENCE_READY bool_false_true: [ false, true ] } ] },
          { name: "C"
            control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_STRING } ] }
        ]
        state [ { input_name: "I" output_name: "O" data_type: TYPE_INT32 dims: [ 2, -1 ] } ]
        """
    ).sequence_batching
    assert batching is not None
    assert batching.strategy == "oldest"
    assert (batching.max_queue_delay_us, batching.preferred_batch_sizes) == (300, (2, 4))
    assert batching.max_candidate_sequences == 4
    start = batching.control("START")
    assert start is not None and (start.datatype, start.false_value, start.true_value) == (
        "FP32",
        0.0,
        1.0,
    )
    corrid = batching.control("CORRID")
    assert corrid is not None and corrid.datatype == "BYTES"
    assert batching.states[0].dims == (2, -1)
    assert batching.server_inputs == {"S", "R", "C", "I"}


@pytest.mark.parametrize(
    ("text", "extra", "reason"),
    [
        (
            'control_input [ { name: "INPUT" control [ { kind: CONTROL_SEQUENCE_START '
            "int32_false_true: [ 0, 1 ] } ] } ]",
            "",
            "control_input 'INPUT' is also a model input",
        ),
        (
            'control_input [ { name: "S" control [ { kind: CONTROL_SEQUENCE_START } ] } ]',
            "",
            "exactly one of int32_false_true, fp32_false_true and bool_false_true",
        ),
        (
            'control_input [ { name: "C" control [ { kind: CONTROL_SEQUENCE_CORRID '
            "data_type: TYPE_FP32 } ] } ]",
            "",
            "data_type must be TYPE_UINT64, TYPE_INT64, TYPE_UINT32, TYPE_INT32 or TYPE_STRING",
        ),
        (
            'control_input [ { name: "A" control [ { kind: CONTROL_SEQUENCE_END '
            'int32_false_true: [ 0, 1 ] } ] }, { name: "B" control [ { kind: '
            "CONTROL_SEQUENCE_END int32_false_true: [ 0, 1 ] } ] } ]",
            "",
            "more than one CONTROL_SEQUENCE_END control",
        ),
        (
            'state [ { input_name: "I" output_name: "O" data_type: TYPE_FP32 dims: [ 0 ] } ]',
            "",
            "dims must be non-empty, each > 0 or -1",
        ),
        (
            'state [ { input_name: "I" output_name: "O" data_type: TYPE_FP32 dims: [ 1 ] '
            'initial_state: { data_type: TYPE_FP32 dims: [ 1 ] data_file: "../x" } } ]',
            "",
            "initial_state data_file must be a plain file name",
        ),
    ],
)
def test_bad_sequence_batching_names_the_field(text: str, extra: str, reason: str) -> None:
    with pytest.raises(InvalidConfig, match="sequence_batching: ") as info:
        _parse(text, extra)
    assert reason in info.value.message


def test_a_decoupled_sequence_model_is_refused_clearly() -> None:
    with pytest.raises(InvalidConfig, match=r"decoupled models .* cannot be sequence models"):
        _parse("", "model_transaction_policy { decoupled: true }")


def test_dynamic_and_sequence_batching_exclude_each_other() -> None:
    with pytest.raises(InvalidConfig, match='"sequence_batching" is specified along with'):
        _parse("", "dynamic_batching { }")


def test_a_request_names_its_sequence() -> None:
    ref = sequence_of({"sequence_id": 12, "sequence_start": True}, "m")
    assert (ref.id, ref.start, ref.end) == (12, True, False)
    assert sequence_of({"sequence_id": "abc", "sequence_end": True}, "m").end
    for bad, message in (
        ({}, "must specify a non-zero or non-empty correlation ID"),
        ({"sequence_id": ""}, "must specify a non-zero or non-empty correlation ID"),
        ({"sequence_id": -1}, "unsigned 64-bit integer"),
        ({"sequence_id": 1 << 64}, "unsigned 64-bit integer"),
        ({"sequence_id": 1.5}, "an unsigned integer or a string"),
        ({"sequence_id": True}, "an unsigned integer or a string"),
        ({"sequence_id": "x" * 257}, "longer than 256 characters"),
        ({"sequence_id": 3, "sequence_end": 1}, "'sequence_end' must be a boolean"),
    ):
        with pytest.raises(InvalidInput, match=message):
            sequence_of(bad, "m")


def test_slots_are_stable_and_spread() -> None:
    slots = [SequenceRef(n, False, False).slot(4) for n in range(1, 401)]
    assert slots == [SequenceRef(n, True, True).slot(4) for n in range(1, 401)]
    assert {slots.count(slot) for slot in range(4)} and min(map(slots.count, range(4))) > 60
    assert SequenceRef(7, False, False).key != SequenceRef("7", False, False).key


def test_checkpoints_round_trip_and_foreign_values_are_ignored() -> None:
    states = {
        "f": np.arange(6, dtype=np.float32).reshape(2, 3),
        "t": np.array([b"a", b"bc"], dtype=object),
    }
    back = _decode(_encode(states))
    assert back is not None
    np.testing.assert_array_equal(back["f"], states["f"])
    assert back["t"].tolist() == [b"a", b"bc"]
    assert _decode(b"not msgpack \xff") is None
    import msgpack

    assert _decode(msgpack.packb({"x": ["|O", [1], b"12345678"]})) is None
    assert _decode(msgpack.packb({"x": ["<f4", [3], b"1234"]})) is None
