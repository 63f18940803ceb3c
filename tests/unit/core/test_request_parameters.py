"""Which request parameters a model sees (:mod:`sluice.core.request_parameters`): Triton's
reserved names, compared as Triton compares them (exactly), are left out; the others,
whatever their case, reach the model."""

from __future__ import annotations

from sluice.core.request_parameters import model_parameters


def test_reserved_names_are_left_out_and_only_they() -> None:
    sent = {
        "sequence_id": 7,
        "priority": 1,
        "timeout": 100,
        "headers": "h",
        "binary_data_output": True,
        "triton_enable_empty_final_response": True,
        # Triton reserves these names exactly: other spellings are the request's own.
        "Priority": 2,
        "Timeout": "slow",
        "TRITON_note": "x",
        "my_priority": 3,
    }
    assert model_parameters(sent) == {
        "Priority": 2,
        "Timeout": "slow",
        "TRITON_note": "x",
        "my_priority": 3,
    }
