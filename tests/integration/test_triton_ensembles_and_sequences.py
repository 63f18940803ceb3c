"""Triton's ensemble, sequence and Python-model details on a real stack, as Triton's users
rely on them:

- a non-batching ensemble feeds a batching (ONNX) model with a batch dimension of 1, and
  answers without it;
- a request for one output of an ensemble runs only the branch that makes it (counted in
  the composing models' statistics);
- an output a composing model did not produce is left out of the answer (no error);
- every ensemble response carries ``sequence_id``, ``sequence_start`` and ``sequence_end``
  (HTTP and a gRPC stream);
- an implicit state output that is also a declared output is answered;
- a Python model sees ``request.flags()`` and ``request.correlation_id()``;
- a sequence model is a step of an ensemble, or called by a Python model (BLS), with the
  request's sequence, each sequence reaching the instance that holds it;
- right after a sequence's END, a request of it without START is refused, on a model of
  four instances, every time.
"""

from __future__ import annotations

import queue
import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from sluice.scheduler.executor.redis_server import RedisServer
from tests.support.model_files import python_config, tensor, write_model
from tests.support.onnx_models import write_identity
from tests.support.stack import Stack

UNARY = """
import numpy as np


class Model:
    def execute(self, inputs):
        x = inputs["X"]
        return {{"Y": ({expression}).astype(np.float32)}}
"""

PARTIAL = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y1", x + 1)]))
        return responses
"""

COUNTER = """
import numpy as np


class Model:
    def execute(self, inputs):
        count = inputs["COUNT_IN"] + inputs["INPUT"].astype(np.int64)
        return {"TOTAL": count * 10, "COUNT_OUT": count}
"""

FLAGGED = """
import numpy as np
import triton_python_backend_utils as pb_utils

START = pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START
END = pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_END


class TritonPythonModel:
    def initialize(self, args):
        self.totals = {}

    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            sequence, flags = request.correlation_id(), request.flags()
            if flags & START:
                self.totals[sequence] = 0.0
            if sequence not in self.totals:
                error = pb_utils.TritonError(f"sequence {sequence} never started")
                responses.append(pb_utils.InferenceResponse(error=error))
                continue
            self.totals[sequence] += float(x.sum())
            total = self.totals[sequence]
            if flags & END:
                del self.totals[sequence]
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("TOTAL", np.array([[total]], np.float32)),
                pb_utils.Tensor("FLAGS", np.array([[flags]], np.int32)),
                pb_utils.Tensor("KIND", np.array([[type(sequence).__name__.encode()]], object)),
            ]))
        return responses
"""


RELAY = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            call = pb_utils.InferenceRequest(
                model_name="counter",
                requested_output_names=["TOTAL"],
                inputs=[pb_utils.get_input_tensor_by_name(request, "INPUT")],
                correlation_id=request.correlation_id(),
                flags=request.flags(),
            )
            answer = call.exec()
            if answer.has_error():
                responses.append(pb_utils.InferenceResponse(error=answer.error()))
                continue
            total = pb_utils.get_output_tensor_by_name(answer, "TOTAL")
            responses.append(pb_utils.InferenceResponse([total]))
        return responses
"""
"""Calls the sequence model ``counter`` (BLS) with its own request's sequence."""


def _step(model: str, inputs: dict[str, str], outputs: dict[str, str]) -> str:
    maps = [f'input_map {{ key: "{k}" value: "{v}" }}' for k, v in inputs.items()]
    maps += [f'output_map {{ key: "{k}" value: "{v}" }}' for k, v in outputs.items()]
    return f'{{ model_name: "{model}" model_version: -1 {" ".join(maps)} }}'


def _ensemble(
    root: Path, name: str, batch: int, ins: list[str], outs: list[str], *steps: str
) -> None:
    (root / name / "1").mkdir(parents=True)
    (root / name / "config.pbtxt").write_text(
        f'name: "{name}"\nplatform: "ensemble"\nmax_batch_size: {batch}\n'
        f"input [ {', '.join(ins)} ]\noutput [ {', '.join(outs)} ]\n"
        f"ensemble_scheduling {{ step [ {', '.join(steps)} ] }}\n"
    )


def _fp32(name: str) -> str:
    return tensor(name, "TYPE_FP32", "3")


def _build(root: Path) -> None:
    write_identity(root, "ident", ["FP32"], dims=(3,), max_batch_size=8)
    _ensemble(
        root,
        "flat",
        0,
        [_fp32("IN")],
        [_fp32("OUT")],
        _step("ident", {"IN_FP32": "IN"}, {"OUT_FP32": "OUT"}),
    )
    one_to_one = python_config([_fp32("X")], [_fp32("Y")])
    write_model(root, "double", one_to_one, {"1/model.py": UNARY.format(expression="2 * x")})
    write_model(root, "square", one_to_one, {"1/model.py": UNARY.format(expression="x * x")})
    write_model(
        root,
        "partial",
        python_config([_fp32("X")], [_fp32("Y1"), _fp32("Y2")]),
        {"1/model.py": PARTIAL},
    )
    _ensemble(
        root,
        "branches",
        8,
        [_fp32("IN")],
        [_fp32("OUT_A"), _fp32("OUT_B"), _fp32("OUT_C"), _fp32("OUT_D")],
        _step("double", {"X": "IN"}, {"Y": "OUT_A"}),
        _step("square", {"X": "IN"}, {"Y": "OUT_B"}),
        _step("partial", {"X": "IN"}, {"Y1": "OUT_C", "Y2": "OUT_D"}),
    )
    write_model(
        root,
        "counter",
        python_config(
            [tensor("INPUT", "TYPE_INT32", "1")],
            [tensor("TOTAL", "TYPE_INT64", "1"), tensor("COUNT_OUT", "TYPE_INT64", "1")],
            max_batch_size=4,
            extra="""
            sequence_batching {
              max_sequence_idle_microseconds: 60000000
              state [ { input_name: "COUNT_IN" output_name: "COUNT_OUT"
                        data_type: TYPE_INT64 dims: [ 1 ] } ]
            }
            instance_group [ { count: 4 kind: KIND_CPU } ]
            """,
        ),
        {"1/model.py": COUNTER},
    )
    _ensemble(
        root,
        "tally",
        4,
        [tensor("INPUT", "TYPE_INT32", "1")],
        [tensor("TOTAL", "TYPE_INT64", "1")],
        _step("counter", {"INPUT": "INPUT"}, {"TOTAL": "TOTAL"}),
    )
    write_model(
        root,
        "relay",
        python_config(
            [tensor("INPUT", "TYPE_INT32", "1")],
            [tensor("TOTAL", "TYPE_INT64", "1")],
            max_batch_size=4,
        ),
        {"1/model.py": RELAY},
    )
    write_model(
        root,
        "flagged",
        python_config(
            [tensor("X", "TYPE_FP32", "1")],
            [
                tensor("TOTAL", "TYPE_FP32", "1"),
                tensor("FLAGS", "TYPE_INT32", "1"),
                tensor("KIND", "TYPE_STRING", "1"),
            ],
            max_batch_size=4,
            extra="sequence_batching { max_sequence_idle_microseconds: 60000000 }",
        ),
        {"1/model.py": FLAGGED},
    )


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("triton_details")
    _build(root)
    stack = Stack(root, redis_server.url)
    stack.start()
    yield stack
    stack.stop()


def _success(http: httpx.Client, model: str) -> int:
    stats = http.get(f"/v2/models/{model}/stats").json()["model_stats"][0]
    count: int = stats["inference_stats"]["success"]["count"]
    return count


def _fp32_body(shape: list[int], outputs: list[str] | None = None) -> dict[str, Any]:
    size = int(np.prod(shape))
    body: dict[str, Any] = {
        "inputs": [
            {"name": "IN", "shape": shape, "datatype": "FP32", "data": list(range(1, size + 1))}
        ]
    }
    if outputs is not None:
        body["outputs"] = [{"name": name} for name in outputs]
    return body


# -- ensembles ------------------------------------------------------------------------------


def test_a_non_batching_ensemble_feeds_a_batching_model(stack: Stack) -> None:
    with httpx.Client(base_url=stack.url, timeout=30) as http:
        response = http.post("/v2/models/flat/infer", json=_fp32_body([3]))
    assert response.status_code == 200, response.text
    (output,) = response.json()["outputs"]
    assert (output["name"], output["shape"], output["data"]) == ("OUT", [3], [1.0, 2.0, 3.0])
    client = httpclient.InferenceServerClient(stack.address)
    try:
        x = np.array([4.0, 5.0, 6.0], np.float32)
        tensor_in = httpclient.InferInput("IN", [3], "FP32")
        tensor_in.set_data_from_numpy(x, binary_data=True)
        np.testing.assert_array_equal(client.infer("flat", [tensor_in]).as_numpy("OUT"), x)
    finally:
        client.close()


def test_a_request_for_one_output_runs_only_its_branch(stack: Stack) -> None:
    models = ("branches", "double", "square", "partial")
    with httpx.Client(base_url=stack.url, timeout=30) as http:
        before = {model: _success(http, model) for model in models}
        response = http.post("/v2/models/branches/infer", json=_fp32_body([1, 3], ["OUT_A"]))
        assert response.status_code == 200, response.text
        assert [o["name"] for o in response.json()["outputs"]] == ["OUT_A"]
        assert response.json()["outputs"][0]["data"] == [2.0, 4.0, 6.0]
        after = {model: _success(http, model) for model in models}
    assert {model: after[model] - before[model] for model in models} == {
        "branches": 1,
        "double": 1,
        "square": 0,
        "partial": 0,
    }


def test_an_output_the_composing_model_did_not_produce_is_left_out(stack: Stack) -> None:
    with httpx.Client(base_url=stack.url, timeout=30) as http:
        response = http.post(
            "/v2/models/branches/infer", json=_fp32_body([1, 3], ["OUT_C", "OUT_D"])
        )
        everything = http.post("/v2/models/branches/infer", json=_fp32_body([2, 3]))
    assert response.status_code == 200, response.text
    assert [(o["name"], o["data"]) for o in response.json()["outputs"]] == [
        ("OUT_C", [2.0, 3.0, 4.0])
    ]
    assert everything.status_code == 200, everything.text
    assert [o["name"] for o in everything.json()["outputs"]] == ["OUT_A", "OUT_B", "OUT_C"]


def test_ensemble_responses_carry_the_sequence_parameters_over_http(stack: Stack) -> None:
    with httpx.Client(base_url=stack.url, timeout=30) as http:
        plain = http.post("/v2/models/flat/infer", json=_fp32_body([3]))
        body = _fp32_body([3])
        body["parameters"] = {"sequence_id": "order-1", "sequence_start": True}
        flagged = http.post("/v2/models/flat/infer", json=body)
        body["parameters"] = {"sequence_id": 5, "sequence_end": "yes"}
        refused = http.post("/v2/models/flat/infer", json=body)
    assert plain.json()["parameters"] == {
        "sequence_id": 0,
        "sequence_start": False,
        "sequence_end": False,
    }
    assert flagged.json()["parameters"] == {
        "sequence_id": "order-1",
        "sequence_start": True,
        "sequence_end": False,
    }
    assert refused.status_code == 400
    assert refused.json()["error"] == (
        "Unable to parse 'sequence_end': attempt to access JSON non-boolean as boolean"
    )


def test_a_streamed_ensemble_sequence_carries_its_flags(stack: Stack) -> None:
    """Triton's L0_sequence_batcher ensemble check: three requests of a sequence on a gRPC
    stream answer START on the first, END on the last."""
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client = grpcclient.InferenceServerClient(stack.grpc_address)
    sequence_id = random.randint(1, 2**31 - 1)
    try:
        client.start_stream(callback=lambda result, error: answers.put((result, error)))
        x = np.ones((1, 3), np.float32)
        for index in range(3):
            tensor_in = grpcclient.InferInput("IN", [1, 3], "FP32")
            tensor_in.set_data_from_numpy(x)
            client.async_stream_infer(
                "branches",
                [tensor_in],
                outputs=[grpcclient.InferRequestedOutput("OUT_A")],
                request_id=str(index),
                sequence_id=sequence_id,
                sequence_start=index == 0,
                sequence_end=index == 2,
            )
        flags: dict[int, tuple[bool, bool, int]] = {}
        for _ in range(3):
            result, error = answers.get(timeout=30)
            assert error is None, error
            response = result.get_response()
            parameters = response.parameters
            flags[int(response.id)] = (
                parameters["sequence_start"].bool_param,
                parameters["sequence_end"].bool_param,
                parameters["sequence_id"].int64_param,
            )
    finally:
        client.stop_stream(cancel_requests=True)
        client.close()
    assert [flags[i] for i in range(3)] == [
        (True, False, sequence_id),
        (False, False, sequence_id),
        (False, True, sequence_id),
    ]


# -- sequences and Python models ------------------------------------------------------------


def _count(http: httpx.Client, sequence_id: int, value: int, **flags: bool) -> httpx.Response:
    body = {
        "inputs": [{"name": "INPUT", "shape": [1, 1], "datatype": "INT32", "data": [value]}],
        "parameters": {"sequence_id": sequence_id, **flags},
    }
    return http.post("/v2/models/counter/infer", json=body)


def test_a_state_output_that_is_a_declared_output_is_answered(stack: Stack) -> None:
    with httpx.Client(base_url=stack.url, timeout=30) as http:
        first = _count(http, 501, 3, sequence_start=True)
        second = _count(http, 501, 4, sequence_end=True)
    for response in (first, second):
        assert response.status_code == 200, response.text
    outputs = {o["name"]: o["data"] for o in second.json()["outputs"]}
    assert outputs == {"TOTAL": [70], "COUNT_OUT": [7]}


def test_a_python_model_sees_the_sequence_flags_and_id(stack: Stack) -> None:
    client = httpclient.InferenceServerClient(stack.address)
    try:
        for sequence_id, kind in (("order-77", b"str"), (4242, b"int")):
            got = []
            for index, value in enumerate((1.0, 2.0, 4.0)):
                tensor_in = httpclient.InferInput("X", [1, 1], "FP32")
                tensor_in.set_data_from_numpy(np.array([[value]], np.float32))
                result = client.infer(
                    "flagged",
                    [tensor_in],
                    sequence_id=sequence_id,
                    sequence_start=index == 0,
                    sequence_end=index == 2,
                )
                got.append(
                    (
                        float(result.as_numpy("TOTAL")[0, 0]),
                        int(result.as_numpy("FLAGS")[0, 0]),
                        result.as_numpy("KIND")[0, 0],
                    )
                )
            assert got == [(1.0, 1, kind), (3.0, 0, kind), (7.0, 2, kind)]
    finally:
        client.close()


def test_a_request_right_after_end_is_refused_on_every_instance(stack: Stack) -> None:
    """Sequences spread over the model's four instances; each one's END is followed at
    once by a request without START, which Triton refuses (and the model never sees)."""
    refused_text = (
        "inference request for sequence {} to model 'counter' must specify the START flag on "
        "the first request of the sequence"
    )

    def run(sequence_id: int) -> list[tuple[int, str]]:
        seen = []
        with httpx.Client(base_url=stack.url, timeout=30) as http:
            for _ in range(3):
                steps = [
                    _count(http, sequence_id, 1, sequence_start=True),
                    _count(http, sequence_id, 2),
                    _count(http, sequence_id, 3, sequence_end=True),
                    _count(http, sequence_id, 4),
                ]
                seen += [(r.status_code, r.text) for r in steps]
        return seen

    ids = list(range(7001, 7033))
    with ThreadPoolExecutor(8) as pool:
        results = dict(zip(ids, pool.map(run, ids), strict=True))
    for sequence_id, seen in results.items():
        for index, (status, text) in enumerate(seen):
            if index % 4 == 3:
                assert (status, text) == (400, f'{{"error":"{refused_text.format(sequence_id)}"}}')
            else:
                assert status == 200, text


@pytest.mark.parametrize("caller", ["tally", "relay"])
def test_a_sequence_model_called_by_an_ensemble_or_a_python_model_keeps_each_sequence(
    stack: Stack, caller: str
) -> None:
    """As Triton's ensemble gives every step the request's correlation id and flags, and a
    BLS call its own: the sequence model ``counter`` (four instances) keeps a state per
    sequence, whoever calls it."""
    base = 7000 if caller == "tally" else 8000
    sequences = {base + 1: [3, 4, 5], f"{caller}-{base}": [10, 20], base + 2: [1, 1, 1, 1]}

    def send(http: httpx.Client, sequence: int | str, value: int, first: bool, last: bool) -> Any:
        body = {
            "inputs": [{"name": "INPUT", "shape": [1, 1], "datatype": "INT32", "data": [value]}],
            "parameters": {
                "sequence_id": sequence,
                "sequence_start": first,
                "sequence_end": last,
            },
        }
        return http.post(f"/v2/models/{caller}/infer", json=body)

    totals: dict[int | str, list[int]] = {sequence: [] for sequence in sequences}
    with httpx.Client(base_url=stack.url, timeout=30) as http:
        for step in range(4):  # the sequences' requests interleaved
            for sequence, values in sequences.items():
                if step < len(values):
                    answer = send(http, sequence, values[step], step == 0, step == len(values) - 1)
                    assert answer.status_code == 200, answer.text
                    totals[sequence].append(answer.json()["outputs"][0]["data"][0])
        alone = http.post(
            f"/v2/models/{caller}/infer",
            json={"inputs": [{"name": "INPUT", "shape": [1, 1], "datatype": "INT32", "data": [1]}]},
        )
    assert totals == {
        base + 1: [30, 70, 120],
        f"{caller}-{base}": [100, 300],
        base + 2: [10, 20, 30, 40],
    }
    assert alone.status_code == 400, alone.text  # (relayed by "relay" with its code)
    assert (
        "inference request to model 'counter' must specify a non-zero or non-empty correlation ID"
        in alone.json()["error"]
    )
