"""Decoupled models (any number of responses per request) on a real stack: the example
``word_streamer`` (Triton's response sender) and a model in Sluice's API (``stream``)
that calls another model for each response (BLS), and an ensemble whose steps after a
decoupled model run once per response, through /generate_stream and gRPC streaming: every
response arrives, in order, and the final one ends the stream; the routes that carry one
answer refuse them with Triton's texts."""

from __future__ import annotations

import queue
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from sluice.scheduler.executor.redis_server import RedisServer
from tests.integration.conftest import load_examples_builder
from tests.support.stack import Stack

ROOT = Path(__file__).resolve().parents[2]

COUNTER = """
import numpy as np


class Model:
    def initialize(self, config, context):
        self.context = context

    def stream(self, inputs):
        count = int(inputs["COUNT"].reshape(-1)[0])
        if count < 0:
            raise ValueError("COUNT must not be negative")
        for step in range(count):
            value = np.full((1, 4), step, dtype=np.float32)
            total = self.context.infer("add_sub", {"INPUT0": value, "INPUT1": value}, ["OUTPUT0"])
            yield {"STEP": np.array([[step]], dtype=np.int32), "DOUBLED": total["OUTPUT0"]}
"""

COUNTER_CONFIG = """
name: "counter"
backend: "python"
max_batch_size: 4
input [ { name: "COUNT" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [
  { name: "STEP" data_type: TYPE_INT32 dims: [ 1 ] },
  { name: "DOUBLED" data_type: TYPE_FP32 dims: [ 4 ] }
]
model_transaction_policy { decoupled: true }
"""

PIPELINE_CONFIG = """
name: "counter_pipeline"
platform: "ensemble"
max_batch_size: 4
input [ { name: "COUNT" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [
  { name: "STEP" data_type: TYPE_INT32 dims: [ 1 ] },
  { name: "QUAD" data_type: TYPE_FP32 dims: [ 4 ] }
]
ensemble_scheduling {
  step [
    {
      model_name: "counter"
      model_version: -1
      input_map { key: "COUNT" value: "COUNT" }
      output_map [ { key: "STEP" value: "STEP" }, { key: "DOUBLED" value: "doubled" } ]
    },
    {
      model_name: "add_sub"
      model_version: -1
      input_map [ { key: "INPUT0" value: "doubled" }, { key: "INPUT1" value: "doubled" } ]
      output_map { key: "OUTPUT0" value: "QUAD" }
    }
  ]
}
"""
"""An ensemble with a decoupled step: add_sub runs once for each of counter's responses,
and the ensemble answers each time (its config says nothing of decoupling: as in Triton,
it is decoupled because counter is)."""

MIXED_CONFIG = """
name: "mixed_pipeline"
platform: "ensemble"
max_batch_size: 4
input [
  { name: "COUNT" data_type: TYPE_INT32 dims: [ 1 ] },
  { name: "OFFSET" data_type: TYPE_FP32 dims: [ 4 ] }
]
output [ { name: "SUM" data_type: TYPE_FP32 dims: [ 4 ] } ]
ensemble_scheduling {
  step [
    {
      model_name: "counter"
      model_version: -1
      input_map { key: "COUNT" value: "COUNT" }
      output_map { key: "DOUBLED" value: "doubled" }
    },
    {
      model_name: "add_sub"
      model_version: -1
      input_map [ { key: "INPUT0" value: "doubled" }, { key: "INPUT1" value: "OFFSET" } ]
      output_map { key: "OUTPUT0" value: "SUM" }
    }
  ]
}
"""
"""Refused at load, as Triton refuses it: add_sub would read each of counter's responses
with the request's one OFFSET, and which go together is not defined."""


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("decoupled")
    load_examples_builder().build_all(root, models=("word_streamer",))
    shutil.copytree(ROOT / "model_repository" / "triton_python_add_sub", root / "add_sub")
    config = root / "add_sub" / "config.pbtxt"
    config.write_text(config.read_text().replace('"triton_python_add_sub"', '"add_sub"'))
    (root / "counter" / "1").mkdir(parents=True)
    (root / "counter" / "1" / "model.py").write_text(COUNTER)
    (root / "counter" / "config.pbtxt").write_text(COUNTER_CONFIG)
    for name, config in (("counter_pipeline", PIPELINE_CONFIG), ("mixed_pipeline", MIXED_CONFIG)):
        (root / name / "1").mkdir(parents=True)
        (root / name / "config.pbtxt").write_text(config)
    stack = Stack(root, redis_server.url)
    stack.start()
    yield stack
    stack.stop()


def _events(response: httpx.Response) -> list[dict[str, Any]]:
    assert response.headers["content-type"].startswith("text/event-stream")
    chunks = [c for c in response.text.split("\n\n") if c.strip()]
    assert all(c.startswith("data: ") for c in chunks), response.text
    return [orjson.loads(c.removeprefix("data: ")) for c in chunks]


def test_every_word_arrives_in_order_and_the_final_ends_the_stream(stack: Stack) -> None:
    text = "streams arrive one word at a time until the final flag"
    with httpx.Client(base_url=stack.url, timeout=60) as http:
        response = http.post("/v2/models/word_streamer/generate_stream", json={"text_input": text})
    assert response.status_code == 200
    events = _events(response)
    assert [event["text_output"] for event in events] == text.split()
    assert all(event["model_name"] == "word_streamer" for event in events)


def test_an_empty_text_streams_nothing_and_bad_text_is_an_error_event(stack: Stack) -> None:
    with httpx.Client(base_url=stack.url, timeout=60) as http:
        empty = http.post("/v2/models/word_streamer/generate_stream", json={"text_input": ""})
        assert empty.status_code == 200 and _events(empty) == []
        counted = http.post("/v2/models/counter/generate_stream", json={"COUNT": -1})
    assert counted.status_code == 500
    assert "COUNT must not be negative" in counted.json()["error"]


def test_a_sluice_stream_model_calling_another_model_streams_each_answer(stack: Stack) -> None:
    with httpx.Client(base_url=stack.url, timeout=60) as http:
        response = http.post("/v2/models/counter/generate_stream", json={"COUNT": 5})
    assert response.status_code == 200, response.text
    events = _events(response)
    assert [event["STEP"] for event in events] == [0, 1, 2, 3, 4]
    assert [event["DOUBLED"] for event in events] == [[2.0 * s] * 4 for s in range(5)]


def test_routes_with_one_answer_refuse_decoupled_models_as_triton_does(stack: Stack) -> None:
    body = {"inputs": [{"name": "text_input", "shape": [1], "datatype": "BYTES", "data": ["a b"]}]}
    with httpx.Client(base_url=stack.url, timeout=60) as http:
        infer = http.post("/v2/models/word_streamer/infer", json=body)
        generate = http.post("/v2/models/word_streamer/generate", json={"text_input": "a b"})
        job = http.post(
            "/v2/models/word_streamer/infer", json=body, headers={"Prefer": "respond-async"}
        )
    for response in (infer, generate):
        assert response.status_code == 501
        assert response.json()["error"] == (
            "HTTP end point doesn't support models with decoupled transaction policy"
        )
    assert job.status_code == 501 and "is decoupled" in job.json()["error"]
    client = grpcclient.InferenceServerClient(stack.grpc_address)
    try:
        text = grpcclient.InferInput("text_input", [1], "BYTES")
        text.set_data_from_numpy(np.array([b"a b"], dtype=object))
        with pytest.raises(InferenceServerException) as info:
            client.infer("word_streamer", [text])
    finally:
        client.close()
    assert info.value.status() == "StatusCode.UNIMPLEMENTED"
    assert "ModelInfer RPC doesn't support models with decoupled transaction policy" in str(
        info.value
    )


@pytest.mark.parametrize("empty_final", [False, True])
def test_grpc_streaming_carries_every_response(stack: Stack, empty_final: bool) -> None:
    answers: queue.Queue[Any] = queue.Queue()
    client = grpcclient.InferenceServerClient(stack.grpc_address)
    sentences = ["one two three", "four five"]
    try:
        client.start_stream(callback=lambda result, error: answers.put((result, error)))
        for index, sentence in enumerate(sentences):
            text = grpcclient.InferInput("text_input", [1], "BYTES")
            text.set_data_from_numpy(np.array([sentence.encode()], dtype=object))
            client.async_stream_infer(
                "word_streamer",
                [text],
                request_id=str(index),
                enable_empty_final_response=empty_final,
            )
        words: dict[str, list[str]] = {"0": [], "1": []}
        finals: dict[str, int] = {"0": 0, "1": 0}
        expected = 5 + (2 if empty_final else 0)
        for _ in range(expected):
            try:
                result, error = answers.get(timeout=30)
            except queue.Empty:
                log = "".join(stack.stderr_lines[-30:])
                pytest.fail(f"a response did not come within 30 s; the stack's log ends:\n{log}")
            assert error is None, error.message()
            response = result.get_response()
            final = response.parameters.get("triton_final_response")
            if final is not None and final.bool_param:
                finals[response.id] += 1
                continue
            words[response.id].append(result.as_numpy("text_output").reshape(-1)[0].decode())
        assert answers.empty()
    finally:
        client.stop_stream(cancel_requests=True)
        client.close()
    assert words == {"0": ["one", "two", "three"], "1": ["four", "five"]}
    assert finals == ({"0": 1, "1": 1} if empty_final else {"0": 0, "1": 0})


def test_generate_passes_triton_parameters_to_the_model_as_triton(stack: Stack) -> None:
    """Triton's generate reads none of the reserved names: they are the model's parameters
    (its /infer refuses them; see tests/unit/gateway/http/test_generate_parameters.py)."""
    body = {"text_input": "a b", "parameters": {"triton_enable_empty_final_response": "yes"}}
    other = {"text_input": "a b", "parameters": {"triton_secret": True}}
    with httpx.Client(base_url=stack.url, timeout=60) as http:
        flag = http.post("/v2/models/word_streamer/generate_stream", json=body)
        reserved = http.post("/v2/models/word_streamer/generate_stream", json=other)
    for answer in (flag, reserved):
        assert answer.status_code == 200, answer.text
        assert [event["text_output"] for event in _events(answer)] == ["a", "b"]


def test_an_ensemble_with_a_decoupled_step_answers_once_per_response(stack: Stack) -> None:
    with httpx.Client(base_url=stack.url, timeout=60) as http:
        config = http.get("/v2/models/counter_pipeline/config").json()
        response = http.post("/v2/models/counter_pipeline/generate_stream", json={"COUNT": 6})
        none = http.post("/v2/models/counter_pipeline/generate_stream", json={"COUNT": 0})
        failing = http.post("/v2/models/counter_pipeline/generate_stream", json={"COUNT": -1})
        one_answer = http.post("/v2/models/counter_pipeline/generate", json={"COUNT": 2})
    assert config["model_transaction_policy"]["decoupled"] is True
    assert response.status_code == 200, response.text
    events = _events(response)
    # In the order counter sent them, though add_sub may finish them out of order.
    assert [event["STEP"] for event in events] == [0, 1, 2, 3, 4, 5]
    assert [event["QUAD"] for event in events] == [[4.0 * s] * 4 for s in range(6)]
    assert all(event["model_name"] == "counter_pipeline" for event in events)
    assert none.status_code == 200 and _events(none) == []
    assert failing.status_code == 500
    assert "in ensemble 'counter_pipeline', step 0 (model 'counter')" in failing.json()["error"]
    assert "COUNT must not be negative" in failing.json()["error"]
    assert one_answer.status_code == 501
    assert "decoupled transaction policy" in one_answer.json()["error"]


def test_a_decoupled_ensemble_streams_over_grpc_and_marks_its_final_response(
    stack: Stack,
) -> None:
    answers: queue.Queue[Any] = queue.Queue()
    client = grpcclient.InferenceServerClient(stack.grpc_address)
    counts = {"a": 4, "b": 2}
    try:
        client.start_stream(callback=lambda result, error: answers.put((result, error)))
        for request_id, count in counts.items():
            value = grpcclient.InferInput("COUNT", [1, 1], "INT32")
            value.set_data_from_numpy(np.array([[count]], dtype=np.int32))
            client.async_stream_infer(
                "counter_pipeline", [value], request_id=request_id, enable_empty_final_response=True
            )
        steps: dict[str, list[int]] = {"a": [], "b": []}
        ended: set[str] = set()
        while ended != set(counts):
            try:
                result, error = answers.get(timeout=30)
            except queue.Empty:
                log = "".join(stack.stderr_lines[-30:])
                pytest.fail(f"a response did not come within 30 s; the stack's log ends:\n{log}")
            assert error is None, error.message()
            response = result.get_response()
            assert response.id not in ended, "a response after the final one"
            if response.outputs:
                step = int(result.as_numpy("STEP").reshape(-1)[0])
                steps[response.id].append(step)
                assert result.as_numpy("QUAD").tolist() == [[4.0 * step] * 4]
            if response.parameters["triton_final_response"].bool_param:
                ended.add(response.id)
    finally:
        client.stop_stream(cancel_requests=True)
        client.close()
    assert steps == {"a": [0, 1, 2, 3], "b": [0, 1]}


def test_a_step_reading_a_decoupled_models_responses_with_other_tensors_is_refused(
    stack: Stack,
) -> None:
    with httpx.Client(base_url=stack.url, timeout=30) as http:
        index = {row["name"]: row for row in http.post("/v2/repository/index").json()}
    assert index["mixed_pipeline"]["state"] == "UNAVAILABLE"
    assert (
        "in ensemble mixed_pipeline, step of model 'add_sub' receives inputs originated from "
        "different decoupled models" in index["mixed_pipeline"]["reason"]
    )


def _response_counts(http: httpx.Client) -> dict[str, dict[str, int]]:
    [stats] = http.get("/v2/models/word_streamer/stats").json()["model_stats"]
    return {
        index: {kind: duration["count"] for kind, duration in kinds.items()}
        for index, kinds in stats["response_stats"].items()
    }


def test_response_stats_count_each_response_under_its_index(stack: Stack) -> None:
    """Triton's ``response_stats``: three words are responses 0-2, and the final flag sent
    alone is response 3, an empty response; the same over gRPC's ModelStatistics."""
    with httpx.Client(base_url=stack.url, timeout=60) as http:
        before = _response_counts(http)
        streamed = http.post(
            "/v2/models/word_streamer/generate_stream", json={"text_input": "three more words"}
        )
        assert streamed.status_code == 200 and len(_events(streamed)) == 3
        deadline = time.monotonic() + 30
        after = _response_counts(http)
        while (
            after.get("3", {}).get("empty_response", 0)
            == before.get("3", {}).get("empty_response", 0)
            and time.monotonic() < deadline
        ):
            time.sleep(0.1)
            after = _response_counts(http)

    def added(index: str, kind: str) -> int:
        return after.get(index, {}).get(kind, 0) - before.get(index, {}).get(kind, 0)

    for index in ("0", "1", "2"):
        assert (added(index, "success"), added(index, "compute_infer")) == (1, 1), after
    assert (added("3", "empty_response"), added("3", "success")) == (1, 0), after
    client = grpcclient.InferenceServerClient(stack.grpc_address)
    try:
        [stats] = client.get_inference_statistics("word_streamer").model_stats
    finally:
        client.close()
    assert stats.response_stats["3"].empty_response.count == after["3"]["empty_response"]
    assert stats.response_stats["0"].success.ns > 0
