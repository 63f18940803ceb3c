"""Sequence batching on a real stack: interleaved sequences from many clients, both
strategies, Triton's control tensors and implicit state, string and integer correlation
ids, and Triton's errors for requests that name no sequence, skip START, or come after
the sequence went idle; a correlation id the model's CORRID input cannot hold is refused;
one tenant cannot reach another's sequence by its id."""

from __future__ import annotations

import queue
import random
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.grpc import service_pb2, service_pb2_grpc

from sluice.scheduler.executor.redis_server import RedisServer
from tests.integration.conftest import load_examples_builder
from tests.support.stack import Stack

ECHO_CONFIG = """
name: "{name}"
backend: "python"
max_batch_size: 8
input [ {{ name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] }} ]
output [
  {{ name: "START_OUT" data_type: TYPE_INT32 dims: [ 1 ] }},
  {{ name: "END_OUT" data_type: TYPE_FP32 dims: [ 1 ] }},
  {{ name: "READY_OUT" data_type: TYPE_BOOL dims: [ 1 ] }},
  {{ name: "CORRID_OUT" data_type: {corrid_type} dims: [ 1 ] }},
  {{ name: "COUNT" data_type: TYPE_INT64 dims: [ 1 ] }}
]
sequence_batching {{
  {strategy}
  max_sequence_idle_microseconds: {idle_us}
  control_input [
    {{ name: "START" control [ {{ kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] }} ] }},
    {{ name: "END" control [ {{ kind: CONTROL_SEQUENCE_END fp32_false_true: [ 0, 1 ] }} ] }},
    {{ name: "READY"
       control [ {{ kind: CONTROL_SEQUENCE_READY bool_false_true: [ false, true ] }} ] }},
    {{ name: "CORRID" control [ {{ kind: CONTROL_SEQUENCE_CORRID data_type: {corrid_type} }} ] }}
  ]
  state [ {{
    input_name: "COUNT_IN" output_name: "COUNT_OUT" data_type: TYPE_INT64 dims: [ 1 ]
    initial_state: {{ data_type: TYPE_INT64 dims: [ 1 ] data_file: "start_at" name: "start" }}
  }} ]
}}
instance_group [ {{ count: {count} kind: KIND_CPU }} ]
"""

ECHO_MODEL = """
import numpy as np


class Model:
    def execute(self, inputs):
        count = inputs["COUNT_IN"] + 1
        return {
            "START_OUT": inputs["START"],
            "END_OUT": inputs["END"],
            "READY_OUT": inputs["READY"],
            "CORRID_OUT": inputs["CORRID"],
            "COUNT": count,
            "COUNT_OUT": count,
        }
"""

TEXT_LENGTH_CONFIG = """
name: "text_length"
backend: "python"
max_batch_size: 4
input [ { name: "TEXT" data_type: TYPE_STRING dims: [ 1 ] } ]
output [ { name: "TOTAL" data_type: TYPE_INT64 dims: [ 1 ] } ]
sequence_batching {
  max_sequence_idle_microseconds: 60000000
  state [ { input_name: "SO_FAR" output_name: "NOW" data_type: TYPE_INT64 dims: [ 1 ] } ]
}
"""

TEXT_LENGTH_MODEL = """
import numpy as np


class Model:
    def execute(self, inputs):
        lengths = np.array([[len(v)] for v in inputs["TEXT"].reshape(-1)], dtype=np.int64)
        total = inputs["SO_FAR"] + lengths
        return {"TOTAL": total, "NOW": total}
"""

START_AT = 100
"""The echo models' initial count (their initial_state data file)."""


def _write_echo(root: Path, name: str, *, corrid: str, strategy: str, idle_us: int) -> None:
    model = root / name
    (model / "1").mkdir(parents=True)
    (model / "initial_state").mkdir()
    (model / "initial_state" / "start_at").write_bytes(np.int64(START_AT).tobytes())
    (model / "1" / "model.py").write_text(ECHO_MODEL)
    (model / "config.pbtxt").write_text(
        ECHO_CONFIG.format(
            name=name, corrid_type=corrid, strategy=strategy, idle_us=idle_us, count=2
        )
    )


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("sequences")
    load_examples_builder().build_all(root, models=("accumulator",))
    oldest = (root / "accumulator" / "config.pbtxt").read_text()
    oldest = oldest.replace('name: "accumulator"', 'name: "accumulator_oldest"').replace(
        "direct { }", "oldest { max_candidate_sequences: 8 max_queue_delay_microseconds: 2000 }"
    )
    (root / "accumulator_oldest" / "1").mkdir(parents=True)
    (root / "accumulator_oldest" / "config.pbtxt").write_text(oldest)
    (root / "accumulator_oldest" / "1" / "model.py").write_text(
        (root / "accumulator" / "1" / "model.py").read_text()
    )
    (root / "text_length" / "1").mkdir(parents=True)
    (root / "text_length" / "1" / "model.py").write_text(TEXT_LENGTH_MODEL)
    (root / "text_length" / "config.pbtxt").write_text(TEXT_LENGTH_CONFIG)
    _write_echo(root, "echo_u64", corrid="TYPE_UINT64", strategy="direct { }", idle_us=400_000)
    _write_echo(root, "echo_str", corrid="TYPE_STRING", strategy="oldest { }", idle_us=60_000_000)
    stack = Stack(root, redis_server.url)
    stack.start()
    yield stack
    stack.stop()


def _body(value: float | int, datatype: str, **parameters: Any) -> dict[str, Any]:
    return {
        "inputs": [{"name": "INPUT", "shape": [1, 1], "datatype": datatype, "data": [value]}],
        "parameters": parameters,
    }


def _post(http: httpx.Client, model: str, body: dict[str, Any]) -> httpx.Response:
    return http.post(f"/v2/models/{model}/infer", json=body)


def _outputs(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 200, response.text
    return {o["name"]: o["data"][0] for o in response.json()["outputs"]}


@pytest.mark.parametrize("model", ["accumulator", "accumulator_oldest"])
def test_interleaved_sequences_each_equal_their_own_running_sum(stack: Stack, model: str) -> None:
    rng = random.Random(7)
    sequences = {
        (1000 + n if n % 2 else f"client-{n}"): [
            rng.randint(-5, 9) for _ in range(rng.randint(3, 9))
        ]
        for n in range(24)
    }

    def run(item: tuple[int | str, list[int]]) -> tuple[list[float], list[float]]:
        sequence_id, values = item
        got = []
        with httpx.Client(base_url=stack.url, timeout=30) as http:
            for index, value in enumerate(values):
                flags = {"sequence_start": index == 0, "sequence_end": index == len(values) - 1}
                body = _body(value, "FP32", sequence_id=sequence_id, **flags)
                got.append(_outputs(_post(http, model, body))["OUTPUT"])
                time.sleep(rng.random() * 0.004)
        return got, list(np.cumsum(values, dtype=np.float64))

    with ThreadPoolExecutor(12) as pool:
        for got, expected in pool.map(run, sequences.items()):
            assert got == expected


def test_control_tensors_and_implicit_state_are_tritons(stack: Stack) -> None:
    with httpx.Client(base_url=stack.url, timeout=30) as http:
        first = _outputs(
            _post(http, "echo_u64", _body(1, "INT32", sequence_id=77, sequence_start=True))
        )
        middle = _outputs(_post(http, "echo_u64", _body(2, "INT32", sequence_id=77)))
        last = _outputs(
            _post(http, "echo_u64", _body(3, "INT32", sequence_id=77, sequence_end=True))
        )
    assert (first["START_OUT"], first["END_OUT"], first["READY_OUT"]) == (1, 0.0, True)
    assert (middle["START_OUT"], middle["END_OUT"], middle["READY_OUT"]) == (0, 0.0, True)
    assert (last["START_OUT"], last["END_OUT"], last["READY_OUT"]) == (0, 1.0, True)
    assert [first["CORRID_OUT"], middle["CORRID_OUT"], last["CORRID_OUT"]] == [77, 77, 77]
    # The state starts from the initial_state data file and follows COUNT_OUT.
    assert [first["COUNT"], middle["COUNT"], last["COUNT"]] == [
        START_AT + 1,
        START_AT + 2,
        START_AT + 3,
    ]


def test_string_correlation_ids_reach_the_model(stack: Stack) -> None:
    client = httpclient.InferenceServerClient(stack.address)
    try:
        for step, flags in enumerate(({"sequence_start": True}, {}, {"sequence_end": True})):
            value = httpclient.InferInput("INPUT", [1, 1], "INT32")
            value.set_data_from_numpy(np.array([[step]], dtype=np.int32))
            result = client.infer("echo_str", [value], sequence_id="order-9f3", **flags)
            assert result.as_numpy("CORRID_OUT").reshape(-1)[0] == b"order-9f3"
            assert result.as_numpy("COUNT").reshape(-1)[0] == START_AT + step + 1
    finally:
        client.close()


def test_a_correlation_id_of_the_other_kind(stack: Stack) -> None:
    """A string id for a model whose CORRID input is an integer is refused at the gateway
    (400); an integer id for a model whose CORRID input is a string reaches it as its text."""
    with httpx.Client(base_url=stack.url, timeout=30) as http:
        text = _post(http, "echo_u64", _body(1, "INT32", sequence_id="abc", sequence_start=True))
        number = _post(http, "echo_str", _body(1, "INT32", sequence_id=5150, sequence_start=True))
    assert text.status_code == 400
    assert text.json()["error"] == (
        "inference request for sequence abc to model 'echo_u64': its CORRID control input is "
        "UINT64, which takes integer correlation IDs, not strings"
    )
    assert _outputs(number)["CORRID_OUT"] == "5150"


def test_a_negative_grpc_correlation_id_is_read_as_tritons_core_reads_it(stack: Stack) -> None:
    """Over gRPC an integer ``sequence_id`` is an ``int64_param`` (tritonclient's), which
    Triton's core holds as an unsigned 64-bit integer: -1 is the sequence 2^64-1. Another
    kind of value is refused, with Triton's text, as it is for every model."""
    with grpcclient.InferenceServerClient(stack.grpc_address) as client:
        for step, flags in enumerate(({"sequence_start": True}, {"sequence_end": True})):
            value = grpcclient.InferInput("INPUT", [1, 1], "INT32")
            value.set_data_from_numpy(np.array([[step]], dtype=np.int32))
            result = client.infer("echo_u64", [value], sequence_id=-1, **flags)
            assert result.as_numpy("CORRID_OUT").reshape(-1).tolist() == [(1 << 64) - 1]
            assert result.as_numpy("COUNT").reshape(-1)[0] == START_AT + step + 1
    request = service_pb2.ModelInferRequest(model_name="echo_u64")
    request.inputs.add(name="INPUT", datatype="INT32", shape=[1, 1])
    request.raw_input_contents.append(np.zeros(1, np.int32).tobytes())
    request.parameters["sequence_id"].uint64_param = 7
    request.parameters["sequence_start"].bool_param = True
    with grpc.insecure_channel(stack.grpc_address) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.ModelInfer(request, timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == (
        "invalid value type for 'sequence_id' parameter, expected int64_param or string_param."
    )


def test_requests_without_a_sequence_get_tritons_errors(stack: Stack) -> None:
    with httpx.Client(base_url=stack.url, timeout=30) as http:
        none = _post(http, "accumulator", _body(1.0, "FP32"))
        zero = _post(http, "accumulator", _body(1.0, "FP32", sequence_id=0))
        unstarted = _post(http, "accumulator", _body(1.0, "FP32", sequence_id=424242))
        batch = _post(
            http,
            "accumulator",
            {
                "inputs": [{"name": "INPUT", "shape": [2, 1], "datatype": "FP32", "data": [1, 2]}],
                "parameters": {"sequence_id": 5, "sequence_start": True},
            },
        )
        bad_flag = _post(
            http, "accumulator", _body(1.0, "FP32", sequence_id=5, sequence_start="yes")
        )
    for response in (none, zero):
        assert response.status_code == 400
        assert response.json()["error"] == (
            "inference request to model 'accumulator' must specify a non-zero or non-empty "
            "correlation ID"
        )
    assert unstarted.status_code == 400
    assert unstarted.json()["error"] == (
        "inference request for sequence 424242 to model 'accumulator' must specify the START "
        "flag on the first request of the sequence"
    )
    assert batch.status_code == 400
    assert "must specify batch-size 1 due to requirements of sequence batcher" in batch.text
    assert bad_flag.status_code == 400
    assert bad_flag.json()["error"] == (
        "Unable to parse 'sequence_start': attempt to access JSON non-boolean as boolean"
    )


def test_an_idle_sequence_is_forgotten(stack: Stack) -> None:
    with httpx.Client(base_url=stack.url, timeout=30) as http:
        started = _post(http, "echo_u64", _body(1, "INT32", sequence_id=31, sequence_start=True))
        assert started.status_code == 200
        time.sleep(0.8)  # the model's max_sequence_idle_microseconds is 400 ms
        late = _post(http, "echo_u64", _body(2, "INT32", sequence_id=31))
        restarted = _outputs(
            _post(http, "echo_u64", _body(3, "INT32", sequence_id=31, sequence_start=True))
        )
    assert late.status_code == 400
    assert "must specify the START flag on the first request of the sequence" in late.text
    assert restarted["COUNT"] == START_AT + 1


def test_a_sequence_model_refuses_asynchronous_jobs(stack: Stack) -> None:
    body = _body(1.0, "FP32", sequence_id=8, sequence_start=True)
    response = httpx.post(
        f"{stack.url}/v2/models/accumulator/infer",
        json=body,
        headers={"Prefer": "respond-async"},
        timeout=30,
    )
    assert response.status_code == 400
    assert "is a sequence model" in response.json()["error"]


def _stream_sequence(
    stack: Stack, model: str, sequence_id: int, name: str, datatype: str, rows: list[Any]
) -> list[Any]:
    """Send one sequence's requests back to back on one gRPC stream (tritonclient's
    streaming API, as Triton's sequence clients use it); each answer's first output value,
    in the order the requests were sent."""
    answers: queue.Queue[Any] = queue.Queue()
    client = grpcclient.InferenceServerClient(stack.grpc_address)
    got: dict[int, Any] = {}
    try:
        client.start_stream(callback=lambda result, error: answers.put((result, error)))
        for index, row in enumerate(rows):
            tensor = grpcclient.InferInput(name, [1, 1], datatype)
            tensor.set_data_from_numpy(row)
            client.async_stream_infer(
                model,
                [tensor],
                request_id=str(index),
                sequence_id=sequence_id,
                sequence_start=index == 0,
                sequence_end=index == len(rows) - 1,
            )
        for _ in rows:
            result, error = answers.get(timeout=30)
            assert error is None, error
            output = result.get_response().outputs[0].name
            got[int(result.get_response().id)] = result.as_numpy(output).reshape(-1)[0]
    finally:
        client.stop_stream(cancel_requests=True)
        client.close()
    return [got[i] for i in range(len(rows))]


def test_a_grpc_stream_carries_a_sequence_in_order(stack: Stack) -> None:
    values = [3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0]
    rows = [np.array([[value]], dtype=np.float32) for value in values]
    got = _stream_sequence(stack, "accumulator", 991, "INPUT", "FP32", rows)
    assert [float(value) for value in got] == list(np.cumsum(values))


def test_a_large_request_is_not_overtaken_on_a_grpc_stream(stack: Stack) -> None:
    """The first request carries 200 KiB (parsed on a thread), the next ones a few bytes,
    all sent back to back: the sequence still sees them in the order they were sent."""
    texts = [b"x" * 200_000, b"ab", b"cde", b"f"]
    rows = [np.array([[text]], dtype=object) for text in texts]
    got = _stream_sequence(stack, "text_length", 5150, "TEXT", "BYTES", rows)
    lengths = np.cumsum([len(text) for text in texts]).tolist()
    assert [int(value) for value in got] == lengths


TENANT_KEYS = {"team-a": "key-a", "team-b": "key-b"}


@pytest.fixture(scope="module")
def tenants_stack(
    tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer
) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("sequence_tenants")
    load_examples_builder().build_all(root, models=("accumulator",))
    keys = ",".join(f"{tenant}:{key}" for tenant, key in TENANT_KEYS.items())
    stack = Stack(root, redis_server.url, env={"SLUICE_API_KEYS": keys})
    stack.start()
    yield stack
    stack.stop()


def test_a_tenant_cannot_reach_another_tenants_sequence(tenants_stack: Stack) -> None:
    """Team b names the id of team a's running sequence: without START it is refused (it
    neither reads a's running sum nor adds to it nor ends it); its START opens b's own
    sequence; a's goes on as if b had sent nothing."""

    def post(http: httpx.Client, tenant: str, value: float, **parameters: Any) -> httpx.Response:
        headers = {"Authorization": f"Bearer {TENANT_KEYS[tenant]}"}
        body = _body(value, "FP32", sequence_id=4242, **parameters)
        return http.post("/v2/models/accumulator/infer", json=body, headers=headers)

    with httpx.Client(base_url=tenants_stack.url, timeout=30) as http:
        assert _outputs(post(http, "team-a", 5.0, sequence_start=True))["OUTPUT"] == 5.0
        joined = post(http, "team-b", 1.0)
        ended = post(http, "team-b", 1.0, sequence_end=True)
        own = _outputs(post(http, "team-b", 100.0, sequence_start=True))["OUTPUT"]
        kept = _outputs(post(http, "team-a", 2.0, sequence_end=True))["OUTPUT"]
        b_goes_on = _outputs(post(http, "team-b", 1.0))["OUTPUT"]
    for refused in (joined, ended):
        assert refused.status_code == 400, refused.text
        assert "must specify the START flag on the first request" in refused.text
    assert (own, kept, b_goes_on) == (100.0, 7.0, 101.0)
