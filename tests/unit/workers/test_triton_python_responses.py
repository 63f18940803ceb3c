"""A Triton Python model's response parameters (``InferenceResponse(parameters=...)``), as
Triton's Python backend checks them."""

from __future__ import annotations

import json

import pytest

from sluice.workers.backends import triton_python_backend_utils as pb_utils


def test_parameters_are_kept_and_read_back_as_json() -> None:
    response = pb_utils.InferenceResponse([], parameters={"n": 3, "ok": False, "s": "x"})
    assert json.loads(response.parameters()) == {"n": 3, "ok": False, "s": "x"}
    assert json.loads(pb_utils.InferenceResponse([], parameters='{"a": 1}').parameters()) == {
        "a": 1
    }
    assert pb_utils.InferenceResponse([]).parameters() == "{}"
    bounds = {"max": (1 << 63) - 1, "min": -(1 << 63)}
    assert json.loads(pb_utils.InferenceResponse([], parameters=bounds).parameters()) == bounds


@pytest.mark.parametrize(
    ("parameters", "text"),
    [
        ({"f": 1.5}, "must be a bool, int or str"),
        ({"l": [1]}, "must be a bool, int or str"),
        # Triton's int64_param (gRPC cannot carry 1 << 63, the reply entry not 1 << 64)
        ({"n": 1 << 63}, "signed 64-bit integer"),
        ({"n": -(1 << 63) - 1}, "signed 64-bit integer"),
        ('{"n": 18446744073709551616}', "signed 64-bit integer"),
        ({"triton_final_response": True}, "reserved"),
        ("not json", "JSON object"),
        ([("a", 1)], "must be a dict"),
    ],
)
def test_what_triton_refuses_raises(parameters: object, text: str) -> None:
    with pytest.raises(pb_utils.TritonModelException, match=text):
        pb_utils.InferenceResponse([], parameters=parameters)  # type: ignore[arg-type]
