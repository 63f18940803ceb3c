"""Request parameters on Triton's generate extension: a name starting with ``triton_`` is a
parameter as any other there (Triton's generate checks none), where ``/infer`` refuses it."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from sluice.gateway.http import generate_routes
from sluice.gateway.inference.json_parameters import RESERVED_TEXT
from tests.support.onnx_models import identity_config
from tests.unit.gateway.in_process import EchoDispatcher, in_process_gateway


async def _post(dispatcher: EchoDispatcher, path: str, body: dict[str, Any]) -> httpx.Response:
    fast = in_process_gateway("echo", identity_config("echo", ["FP32"], [-1], 8), dispatcher)
    fast.app.include_router(generate_routes.router)
    transport = httpx.ASGITransport(app=fast)
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
        return await client.post(path, json=body)


@pytest.mark.parametrize("route", ["generate", "generate_stream"])
async def test_a_triton_name_goes_to_the_model_as_a_parameter(route: str) -> None:
    dispatcher = EchoDispatcher(["OUT_FP32"])
    body = {
        "IN_FP32": [1.5],
        "triton_top": 3,
        "parameters": {"triton_nested": "x", "triton_enable_empty_final_response": "yes"},
    }
    answer = await _post(dispatcher, f"/v2/models/echo/{route}", body)
    assert answer.status_code == 200, answer.text
    [message] = dispatcher.submitted
    assert message.parameters["triton_top"] == 3
    assert message.parameters["triton_nested"] == "x"
    assert message.parameters["triton_enable_empty_final_response"] == "yes"


async def test_infer_still_refuses_a_triton_name() -> None:
    dispatcher = EchoDispatcher(["OUT_FP32"])
    body = {
        "inputs": [{"name": "IN_FP32", "datatype": "FP32", "shape": [1], "data": [1.5]}],
        "parameters": {"triton_top": 3},
    }
    answer = await _post(dispatcher, "/v2/models/echo/infer", body)
    assert (answer.status_code, answer.json()) == (400, {"error": RESERVED_TEXT})
    assert dispatcher.submitted == []


async def test_a_triton_name_must_still_be_a_scalar() -> None:
    answer = await _post(
        EchoDispatcher(["OUT_FP32"]), "/v2/models/echo/generate", {"IN_FP32": 1, "triton_x": [1]}
    )
    assert answer.status_code == 400
    assert answer.json() == {
        "error": "parameter 'triton_x' has invalid type. It should be either 'int', 'bool', "
        "or 'string'."
    }
