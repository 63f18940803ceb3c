"""The parameters Triton's HTTP frontend reads itself, through the real REST route in
process (no Redis, no worker): one case per parameter and bad value, each answered with
Triton's text (server ``src/http_server.cc``: the request's ``parameters``, an input's
``binary_data_size`` and ``shared_memory_*``, an output's ``binary_data`` and
``classification``). Triton answers 500 where its JSON reader refuses the type (Sluice:
400, see ``docs/differences.md``), 400 for the rest."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.support.onnx_models import identity_config
from tests.unit.gateway.in_process import EchoDispatcher, in_process_gateway

MODEL = "m"
INFER = f"/v2/models/{MODEL}/infer"
UINT64_MAX = 2**64 - 1

UNSIGNED = "attempt to access JSON non-unsigned-integer as unsigned-integer"
BOOLEAN = "attempt to access JSON non-boolean as boolean"
STRING = "attempt to access JSON non-string as string"
RESERVED = (
    "parameter keys starting with 'triton_' are reserved for Triton usage and should not be "
    "specified."
)
CONTENT = (
    "Input must set only one of the following fields: 'data', 'binary_data_size' in "
    "'parameters', 'shared_memory_region' in 'parameters'. But"
)


def client() -> httpx.AsyncClient:
    dispatcher = EchoDispatcher(["OUT_FP32"])
    app = in_process_gateway(MODEL, identity_config(MODEL, ["FP32"], (4,), 8), dispatcher)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway")


def body(
    parameters: dict[str, Any] | None = None,
    input_parameters: dict[str, Any] | None = None,
    output_parameters: dict[str, Any] | None = None,
    data: bool = True,
) -> dict[str, Any]:
    tensor: dict[str, Any] = {"name": "IN_FP32", "shape": [1, 4], "datatype": "FP32"}
    if data:
        tensor["data"] = [1.0, 2.0, 3.0, 4.0]
    if input_parameters is not None:
        tensor["parameters"] = input_parameters
    document: dict[str, Any] = {"inputs": [tensor]}
    if parameters is not None:
        document["parameters"] = parameters
    if output_parameters is not None:
        document["outputs"] = [{"name": "OUT_FP32", "parameters": output_parameters}]
    return document


def _request(name: str, values: list[Any], text: str) -> list[Any]:
    return [pytest.param(body({name: v}), text, id=f"{name}={v!r}") for v in values]


def _input(name: str, values: list[Any], text: str, **others: Any) -> list[Any]:
    """Inputs with ``name`` set to each of ``values``, and ``data`` unless the parameters
    say where else the data is."""
    cases = []
    for v in values:
        parameters = {**others, name: v}
        elsewhere = "shared_memory_region" in parameters or "binary_data_size" in parameters
        document = body(input_parameters=parameters, data=not elsewhere)
        cases.append(pytest.param(document, text, id=f"input {name}={v!r}"))
    return cases


def _output(name: str, values: list[Any], text: str, **others: Any) -> list[Any]:
    return [
        pytest.param(
            body(output_parameters={**others, name: v}), text, id=f"output {name}={v!r}{others}"
        )
        for v in values
    ]


SHM = {"shared_memory_region": "r", "shared_memory_byte_size": 16}

CASES = [
    # The request's parameters.
    *_request(
        "sequence_id",
        [-1, 1.5, True, None, {}, [], UINT64_MAX + 1],
        f"Unable to parse 'sequence_id': {STRING}",
    ),
    *_request(
        "sequence_start", ["true", 1, None, {}], f"Unable to parse 'sequence_start': {BOOLEAN}"
    ),
    *_request("sequence_end", ["false", 0, None], f"Unable to parse 'sequence_end': {BOOLEAN}"),
    *_request(
        "priority",
        ["1", -1, 1.5, True, None, {}, UINT64_MAX + 1],
        f"Unable to parse 'priority': {UNSIGNED}",
    ),
    *_request(
        "timeout",
        ["1", -1, 1.5, False, None, [], UINT64_MAX + 1],
        f"Unable to parse 'timeout': {UNSIGNED}",
    ),
    *_request(
        "binary_data_output", ["true", 1, None], f"Unable to parse 'binary_data_output': {BOOLEAN}"
    ),
    *_request("triton_enable_empty_final_response", [True], RESERVED),
    *_request("triton_anything", [1, "x"], RESERVED),
    *_request(
        "custom",
        [None, {}, [1]],
        "parameter 'custom' has invalid type. It should be either 'int', 'bool', or 'string'.",
    ),
    # An input's parameters.
    *_input(
        "binary_data_size",
        ["16", -1, 1.5, True, None, UINT64_MAX + 1],
        f"Unable to parse 'binary_data_size': {UNSIGNED}; input 'IN_FP32'",
    ),
    *_input(
        "shared_memory_region",
        [1, None, True, {}],
        f"Unable to parse 'shared_memory_region': {STRING}; input 'IN_FP32'",
        shared_memory_byte_size=16,
    ),
    *_input(
        "shared_memory_offset",
        ["0", -1, 1.5, None],
        f"Unable to parse 'shared_memory_offset': {UNSIGNED}; input 'IN_FP32'",
        **SHM,
    ),
    *_input(
        "shared_memory_byte_size",
        ["16", -16, 16.0, None, UINT64_MAX + 1],
        f"Unable to parse 'shared_memory_byte_size': {UNSIGNED}; input 'IN_FP32'",
        shared_memory_region="r",
    ),
    *_input(
        "shared_memory_offset",
        [0],
        "'shared_memory_offset' can not be specified without 'shared_memory_region' parameter "
        "for tensor 'IN_FP32'",
    ),
    *_input(
        "shared_memory_byte_size",
        [16],
        "'shared_memory_byte_size' can not be specified without 'shared_memory_region' "
        "parameter for tensor 'IN_FP32'",
    ),
    *_input(
        "shared_memory_region",
        ["r"],
        "'shared_memory_byte_size' must be specified along with 'shared_memory_region' "
        "parameter for tensor 'IN_FP32'",
    ),
    pytest.param(
        body(input_parameters={"binary_data_size": 16}),
        f"{CONTENT} set 'data' 'binary_data_size'; input 'IN_FP32'",
        id="input data and binary_data_size",
    ),
    pytest.param(
        body(input_parameters={**SHM, "binary_data_size": 16}, data=False),
        f"{CONTENT} set 'binary_data_size' 'shared_memory_region'; input 'IN_FP32'",
        id="input binary_data_size and shared_memory_region",
    ),
    pytest.param(
        body(input_parameters={}, data=False),
        f"{CONTENT} no field is set; input 'IN_FP32'",
        id="input without data",
    ),
    # A requested output's parameters.
    *_output(
        "binary_data",
        ["true", 1, None],
        f"Unable to parse 'binary_data': {BOOLEAN}; output 'OUT_FP32'",
    ),
    *_output(
        "binary_data",
        ["false", 0],
        f"Unable to set 'binary_data': {BOOLEAN}; output 'OUT_FP32'",
        **SHM,
    ),
    *_output(
        "classification",
        ["2", -1, 1.5, True, None, UINT64_MAX + 1],
        f"Unable to set 'classification': {UNSIGNED}; output 'OUT_FP32'",
    ),
    *_output(
        "classification",
        [2],
        "Output can't set both 'shared_memory_region' and 'classification'; output 'OUT_FP32'",
        **SHM,
    ),
    *_output(
        "shared_memory_offset",
        [-1],
        f"Unable to parse 'shared_memory_offset': {UNSIGNED}; output 'OUT_FP32'",
        **SHM,
    ),
    *_output(
        "shared_memory_offset",
        [0],
        "'shared_memory_offset' can not be specified without 'shared_memory_region' parameter "
        "for tensor 'OUT_FP32'",
    ),
    *_output(
        "shared_memory_region",
        ["r"],
        "'shared_memory_byte_size' must be specified along with 'shared_memory_region' "
        "parameter for tensor 'OUT_FP32'",
    ),
]


@pytest.mark.parametrize(("document", "text"), CASES)
async def test_a_parameter_triton_reads_is_refused_with_its_text(
    document: dict[str, Any], text: str
) -> None:
    async with client() as http:
        response = await http.post(INFER, json=document)
    assert response.status_code == 400, response.text
    assert response.json() == {"error": text}


@pytest.mark.parametrize(
    "parameters",
    [
        {"priority": UINT64_MAX, "timeout": UINT64_MAX, "sequence_id": UINT64_MAX},
        {"sequence_id": "order-1", "sequence_start": True, "sequence_end": False},
        {"binary_data_output": False, "custom": 1.5, "other": -3, "flag": True},
        {"priority": 0, "timeout": 0, "sequence_id": 0},
    ],
    ids=["largest", "string id", "custom", "zeros"],
)
async def test_the_values_triton_takes_are_taken(parameters: dict[str, Any]) -> None:
    async with client() as http:
        response = await http.post(INFER, json=body(parameters))
    assert response.status_code == 200, response.text
    assert response.json()["outputs"][0]["data"] == [1.0, 2.0, 3.0, 4.0]
