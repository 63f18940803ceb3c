"""Triton's explicit model control against a running stack, through tritonclient: load and
unload while serving, configuration and file overrides, a failed load that leaves the
serving model untouched (and one of a model not serving, listed as failed, as in Triton),
and an unload that answers every admitted request first."""

from __future__ import annotations

import json
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from redis import Redis
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from sluice.core.keys import Keys
from sluice.scheduler.executor.redis_server import RedisServer
from tests.support.load import slow_request
from tests.support.model_files import DOUBLE_MODEL, write_fragile
from tests.support.onnx_models import write_identity
from tests.support.procs import wait_until
from tests.support.slow_model import write_slow
from tests.support.stack import Stack

UNLOADABLE = 'raise RuntimeError("the weights are missing")\n'
"""A Python model that cannot be loaded."""
IDENT = {"inputs": [{"name": "IN_FP32", "shape": [1, 3], "datatype": "FP32", "data": [1, 2, 3]}]}
DOUBLE = {"inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [1, 2]}]}


@pytest.fixture(scope="module")
def explicit(
    tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer
) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("explicit")
    write_identity(root, "ident", ["FP32"])
    write_fragile(root, "double")
    write_slow(root, "slow", max_batch_size=1)
    write_fragile(root, "flaky")
    (root / "flaky" / "1" / "model.py").write_text(UNLOADABLE)
    stack = Stack(
        root, redis_server.url, args=["--model-control-mode", "explicit", "--load-model", "ident"]
    )
    stack.start()
    yield stack
    stack.stop()


@pytest.fixture
def client(explicit: Stack) -> Iterator[httpclient.InferenceServerClient]:
    client = httpclient.InferenceServerClient(explicit.address, network_timeout=120)
    yield client
    client.close()


def states(client: httpclient.InferenceServerClient) -> dict[str, tuple[str, str]]:
    return {
        row["name"]: (row.get("state", ""), row.get("reason", ""))
        for row in client.get_model_repository_index()
    }


def test_only_the_models_asked_for_are_loaded_at_start(
    explicit: Stack, client: httpclient.InferenceServerClient
) -> None:
    index = states(client)
    assert index["ident"] == ("READY", "")
    assert index["double"] == ("", "")  # (never loaded: by its name alone, as in Triton)
    assert client.is_server_ready()  # readiness is about the loaded models
    assert client.is_model_ready("ident")
    assert not client.is_model_ready("double")
    assert httpx.post(f"{explicit.url}/v2/models/double/infer", json=DOUBLE).status_code == 503


def test_load_serves_and_unload_stops(
    explicit: Stack, client: httpclient.InferenceServerClient
) -> None:
    client.load_model("double")
    assert states(client)["double"] == ("READY", "")
    answer = httpx.post(f"{explicit.url}/v2/models/double/infer", json=DOUBLE, timeout=30)
    assert answer.status_code == 200
    assert answer.json()["outputs"][0]["data"] == [2.0, 4.0]
    client.unload_model("double")
    assert states(client)["double"] == ("UNAVAILABLE", "unloaded")
    refused = httpx.post(f"{explicit.url}/v2/models/double/infer", json=DOUBLE, timeout=30)
    assert refused.status_code == 503
    assert "unloaded" in refused.json()["error"]
    client.unload_model("double")  # unloading what is not loaded succeeds, as in Triton


def test_loading_an_unknown_model_says_so(client: httpclient.InferenceServerClient) -> None:
    with pytest.raises(InferenceServerException) as failure:
        client.load_model("nope")
    assert "failed to load 'nope', failed to poll from model repository" in str(failure.value)
    with pytest.raises(InferenceServerException, match="invalid model name"):
        client.load_model("..")


def test_config_override_reloads_the_serving_model(
    explicit: Stack, client: httpclient.InferenceServerClient
) -> None:
    config = client.get_model_config("ident")
    assert config["max_batch_size"] == 8
    override = {
        "backend": "onnxruntime",
        "max_batch_size": 4,
        "input": [{"name": "IN_FP32", "data_type": "TYPE_FP32", "dims": [-1]}],
        "output": [{"name": "OUT_FP32", "data_type": "TYPE_FP32", "dims": [-1]}],
    }
    client.load_model("ident", config=json.dumps(override))
    assert client.get_model_config("ident")["max_batch_size"] == 4
    assert httpx.post(f"{explicit.url}/v2/models/ident/infer", json=IDENT).status_code == 200
    client.load_model("ident")  # back to the repository's configuration
    assert client.get_model_config("ident")["max_batch_size"] == 8


def live_pids(stack: Stack, redis_server: RedisServer, model: str, count: int) -> set[int]:
    """The pids of ``model``'s live workers once ``count`` are live (a retired worker leaves
    the live set a moment after the load answered: it hands over what it held first)."""
    client = Redis.from_url(redis_server.url)
    key = Keys(stack.namespace).live_workers(model, 1)
    try:
        pids: set[int] = set()

        def settled() -> bool:
            members = cast(list[bytes], client.zrangebyscore(key, time.time(), "+inf"))
            pids.clear()
            pids.update(int(member.decode().rsplit("-", 2)[-2]) for member in members)
            return len(pids) == count

        assert wait_until(settled, 30), pids
        return set(pids)
    finally:
        client.close()


def test_a_load_that_changes_only_the_instances_updates_the_model(
    explicit: Stack, redis_server: RedisServer, client: httpclient.InferenceServerClient
) -> None:
    """As Triton: a configuration whose instance count alone changed adds or removes
    instances, and the others go on serving (the same processes); once the model's files
    changed, the same load reloads it."""
    client.load_model("ident")  # (the repository's configuration, one instance)
    (first,) = live_pids(explicit, redis_server, "ident", 1)
    config = client.get_model_config("ident")
    config["instance_group"] = [{"kind": "KIND_CPU", "count": 2}]
    client.load_model("ident", config=json.dumps(config))
    assert first in live_pids(explicit, redis_server, "ident", 2)
    config["instance_group"] = [{"kind": "KIND_CPU", "count": 1}]
    client.load_model("ident", config=json.dumps(config))
    assert live_pids(explicit, redis_server, "ident", 1) == {first}
    assert httpx.post(f"{explicit.url}/v2/models/ident/infer", json=IDENT).status_code == 200

    model_file = explicit.repository / "ident" / "1" / "model.onnx"
    model_file.write_bytes(model_file.read_bytes())  # (the same model, written again)
    client.load_model("ident", config=json.dumps(config))
    assert first not in live_pids(explicit, redis_server, "ident", 1)
    assert httpx.post(f"{explicit.url}/v2/models/ident/infer", json=IDENT).status_code == 200


def test_a_failed_load_leaves_the_serving_model_untouched(
    explicit: Stack, client: httpclient.InferenceServerClient
) -> None:
    """A reload whose model file cannot be loaded: ident answers throughout, with the old
    configuration, and the load's error says why."""
    answers: list[int] = []
    stop = threading.Event()

    def keep_asking() -> None:
        with httpx.Client(base_url=explicit.url, timeout=30) as http:
            while not stop.is_set():
                answers.append(http.post("/v2/models/ident/infer", json=IDENT).status_code)

    asking = threading.Thread(target=keep_asking)
    asking.start()
    try:
        override = {
            "backend": "onnxruntime",
            "max_batch_size": 2,
            "input": [{"name": "IN_FP32", "data_type": "TYPE_FP32", "dims": [-1]}],
            "output": [{"name": "OUT_FP32", "data_type": "TYPE_FP32", "dims": [-1]}],
        }
        with pytest.raises(InferenceServerException) as failure:
            client.load_model(
                "ident",
                config=json.dumps(override),
                files={"file:1/model.onnx": b"this is not an onnx model"},
            )
        assert "failed to load 'ident'" in str(failure.value)
        time.sleep(1.0)  # a refresh or two of every gateway after the failure
    finally:
        stop.set()
        asking.join(30)
    assert answers and set(answers) == {200}, answers
    assert client.get_model_config("ident")["max_batch_size"] == 8
    assert states(client)["ident"] == ("READY", "")


def test_a_failed_load_is_listed_unavailable_until_a_load_succeeds(
    explicit: Stack, client: httpclient.InferenceServerClient
) -> None:
    """As in Triton, a model whose load failed (not serving before) is UNAVAILABLE in the
    repository index with why, answered 404 `has no available versions` (REST and gRPC),
    and the server is not ready; files fixed, a load serves it. (Sluice's unload clears the
    failure: listed unloaded, and the server is ready again.)"""
    with pytest.raises(InferenceServerException) as failure:
        client.load_model("flaky")
    assert "failed to load 'flaky'" in str(failure.value)
    assert "the weights are missing" in str(failure.value)
    state, reason = states(client)["flaky"]
    assert state == "UNAVAILABLE" and "the weights are missing" in reason, reason
    refused = httpx.post(f"{explicit.url}/v2/models/flaky/infer", json=DOUBLE, timeout=30)
    assert refused.status_code == 404, refused.text
    unknown = "Request for unknown model: 'flaky' has no available versions"
    assert refused.json()["error"].startswith(unknown)
    with grpcclient.InferenceServerClient(explicit.grpc_address) as rpc:
        tensor = grpcclient.InferInput("x", [1, 2], "FP32")
        tensor.set_data_from_numpy(np.array([[1, 2]], dtype=np.float32))
        with pytest.raises(InferenceServerException) as rpc_failure:
            rpc.infer("flaky", [tensor])
    assert rpc_failure.value.status() == "StatusCode.NOT_FOUND"
    assert str(rpc_failure.value.message()).startswith(unknown)
    assert not client.is_server_ready()

    client.unload_model("flaky")
    assert states(client)["flaky"] == ("UNAVAILABLE", "unloaded")
    assert client.is_server_ready()

    with pytest.raises(InferenceServerException):
        client.load_model("flaky")
    assert states(client)["flaky"][0] == "UNAVAILABLE"
    model_file = Path(str(explicit.repository)) / "flaky" / "1" / "model.py"
    model_file.write_text(DOUBLE_MODEL)
    client.load_model("flaky")
    assert states(client)["flaky"] == ("READY", "")
    answer = httpx.post(f"{explicit.url}/v2/models/flaky/infer", json=DOUBLE, timeout=30)
    assert answer.status_code == 200, answer.text
    assert answer.json()["outputs"][0]["data"] == [2.0, 4.0]
    assert client.is_server_ready()
    client.unload_model("flaky")


def test_unload_answers_every_admitted_request_first(
    explicit: Stack, client: httpclient.InferenceServerClient
) -> None:
    client.load_model("slow")
    codes: list[int] = []

    def send(index: int) -> None:
        with httpx.Client(base_url=explicit.url, timeout=60) as http:
            codes.append(
                http.post("/v2/models/slow/infer", json=slow_request(index, 30_000)).status_code
            )

    assert explicit.redis_url is not None
    redis = Redis.from_url(explicit.redis_url)
    seconds, micros = cast(tuple[int, int], redis.time())
    since = f"{seconds * 1000 + micros // 1000}-0"
    streams = Keys(explicit.namespace).request_streams("slow", 1, 0)

    def admitted() -> int:
        """Requests queued since the test began (or answered already)."""
        return len(codes) + sum(len(redis.xrange(s, min=since)) for s in streams)

    senders = [threading.Thread(target=send, args=(i,)) for i in range(4)]
    for sender in senders:
        sender.start()
    # All four admitted and queued behind one another (max_batch_size 1) before the unload.
    assert wait_until(lambda: admitted() >= 4, 30), admitted()
    redis.close()
    client.unload_model("slow")
    for sender in senders:
        sender.join(60)
    assert codes == [200] * 4
    assert states(client)["slow"] == ("UNAVAILABLE", "unloaded")


def test_numpy_inference_after_reloads(client: httpclient.InferenceServerClient) -> None:
    data = np.array([[1.0, 2.0, 3.0]], dtype=np.float32)
    inp = httpclient.InferInput("IN_FP32", list(data.shape), "FP32")
    inp.set_data_from_numpy(data, binary_data=True)
    result = client.infer("ident", [inp])
    assert result.as_numpy("OUT_FP32").tolist() == [[1.0, 2.0, 3.0]]


def test_poll_mode_follows_the_repository(tmp_path: Path, redis_server: RedisServer) -> None:
    """``--model-control-mode poll``: a model added to the repository is loaded, a changed
    configuration is taken, a removed model is unloaded; load / unload requests are refused
    with Triton's text for that mode."""
    repository = tmp_path / "repository"
    write_identity(repository, "ident", ["FP32"])
    stack = Stack(
        repository,
        redis_server.url,
        env={"SLUICE_REPOSITORY_POLL_S": "0.3"},
        args=["--model-control-mode", "poll"],
    )
    stack.start()
    client = httpclient.InferenceServerClient(stack.address, network_timeout=60)
    try:
        # Changes are made beside the repository and renamed into place, as one would.
        write_identity(tmp_path / "new", "extra", ["FP32"])
        (tmp_path / "new" / "extra").rename(repository / "extra")
        assert wait_until(lambda: states(client).get("extra") == ("READY", ""), 30)
        extra = {"inputs": [{**IDENT["inputs"][0]}]}
        assert httpx.post(f"{stack.url}/v2/models/extra/infer", json=extra).status_code == 200

        config = repository / "ident" / "config.pbtxt"
        changed = tmp_path / "config.pbtxt"
        changed.write_text(config.read_text().replace("max_batch_size: 8", "max_batch_size: 4"))
        changed.replace(config)
        assert wait_until(lambda: client.get_model_config("ident")["max_batch_size"] == 4, 30)

        shutil.rmtree(repository / "extra")
        assert wait_until(lambda: states(client).get("extra", ("", ""))[0] != "READY", 30)

        with pytest.raises(InferenceServerException, match="not allowed if polling is enabled"):
            client.load_model("ident")
    finally:
        client.close()
        stack.stop()


CHAIN = """
name: "chain"
platform: "ensemble"
max_batch_size: 8
input [ { name: "IN_FP32" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "OUT_FP32" data_type: TYPE_FP32 dims: [ -1 ] } ]
ensemble_scheduling {
  step [
    { model_name: "first" model_version: -1
      input_map { key: "IN_FP32" value: "IN_FP32" } output_map { key: "OUT_FP32" value: "mid" } },
    { model_name: "second" model_version: -1
      input_map { key: "IN_FP32" value: "mid" } output_map { key: "OUT_FP32" value: "OUT_FP32" } }
  ]
}
"""


def test_an_ensembles_load_loads_the_models_it_calls_and_unload_dependents_unloads_them(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """As Triton: loading an ensemble loads the models it calls (at start too, with
    --load-model), and unloading it with ``unload_dependents`` unloads them; without it,
    they stay; a model it calls that cannot load fails the ensemble's load, naming it."""
    for name in ("first", "second"):
        write_identity(tmp_path, name, ["FP32"])
    for name in ("chain", "again"):
        (tmp_path / name / "1").mkdir(parents=True)
        (tmp_path / name / "config.pbtxt").write_text(CHAIN.replace('"chain"', f'"{name}"'))
    broken = CHAIN.replace('"chain"', '"broken"').replace('"second"', '"unusable"')
    (tmp_path / "broken" / "1").mkdir(parents=True)
    (tmp_path / "broken" / "config.pbtxt").write_text(broken)
    (tmp_path / "unusable" / "1").mkdir(parents=True)
    (tmp_path / "unusable" / "config.pbtxt").write_text('platform: "onnxruntime_onnx"')
    stack = Stack(
        tmp_path,
        redis_server.url,
        args=["--model-control-mode", "explicit", "--load-model", "chain"],
    )
    stack.start()
    client = httpclient.InferenceServerClient(stack.address, network_timeout=120)
    ready = ("READY", "")
    try:
        at_start = states(client)
        assert (at_start["chain"], at_start["first"], at_start["second"]) == (ready,) * 3
        answer = httpx.post(f"{stack.url}/v2/models/chain/infer", json=IDENT, timeout=30)
        assert answer.status_code == 200, answer.text
        assert answer.json()["outputs"][0]["data"] == [1.0, 2.0, 3.0]

        rpc = grpcclient.InferenceServerClient(stack.grpc_address)
        try:  # (over gRPC: the parameter is a bool_param there)
            rpc.unload_model("chain", unload_dependents=True)
        finally:
            rpc.close()
        gone = states(client)
        assert [gone[name][0] for name in ("chain", "first", "second")] == ["UNAVAILABLE"] * 3

        client.load_model("again")  # the models it calls come back with it
        assert [states(client)[m] for m in ("again", "first", "second")] == [ready] * 3
        client.unload_model("again")  # (without unload_dependents: they stay)
        assert [states(client)[m] for m in ("first", "second")] == [ready] * 2

        client.load_model("chain")
        client.load_model("again")
        client.unload_model("chain", unload_dependents=True)  # "again" still calls them
        assert [states(client)[m] for m in ("again", "first", "second")] == [ready] * 3

        # An ensemble loaded with a configuration of the request's own (as Model Analyzer
        # loads them) reads its steps' models beside its staged copy: one step here.
        one_step = {
            "name": "again",
            "platform": "ensemble",
            "max_batch_size": 8,
            "input": [{"name": "IN_FP32", "data_type": "TYPE_FP32", "dims": [-1]}],
            "output": [{"name": "OUT_FP32", "data_type": "TYPE_FP32", "dims": [-1]}],
            "ensemble_scheduling": {
                "step": [
                    {
                        "model_name": "second",
                        "model_version": -1,
                        "input_map": {"IN_FP32": "IN_FP32"},
                        "output_map": {"OUT_FP32": "OUT_FP32"},
                    }
                ]
            },
        }
        client.load_model("again", config=json.dumps(one_step))
        assert states(client)["again"] == ready
        answer = httpx.post(f"{stack.url}/v2/models/again/infer", json=IDENT, timeout=30)
        assert answer.status_code == 200, answer.text
        assert answer.json()["outputs"][0]["data"] == [1.0, 2.0, 3.0]

        with pytest.raises(InferenceServerException) as failure:
            client.load_model("broken")
        assert "failed to load 'broken', failed to load 'unusable'," in str(failure.value)
        after = states(client)  # (each listed with why, as a model failed at the start)
        assert after["unusable"][0] == "UNAVAILABLE" and after["unusable"][1], after
        unusable = f"failed to load 'unusable', {after['unusable'][1]}"
        assert after["broken"] == ("UNAVAILABLE", unusable)
    finally:
        client.close()
        stack.stop()


def test_bad_load_and_unload_requests_say_why(explicit: Stack) -> None:
    url = f"{explicit.url}/v2/repository/models/ident"
    for path, body, text in (
        ("load", b"{", "malformed request body"),
        ("load", b"[1]", "must be a JSON object"),
        ("load", b'{"parameters": []}', "'parameters' must be a JSON object"),
        ("load", b'{"parameters": {"config": 5}}', "'config' must be the model configuration"),
        ("load", b'{"parameters": {"config": "{", "file:1/m.onnx": "@@"}}', "not valid base64"),
        ("load", b'{"parameters": {"file:1/m.onnx": 3}}', "must be base64-encoded"),
        ("load", b'{"parameters": {"config": "{nope"}}', "failed to parse the model configuration"),
        ("unload", b'{"parameters": {"unload_dependents": "yes"}}', "must be a boolean"),
    ):
        answer = httpx.post(f"{url}/{path}", content=body, timeout=30)
        assert answer.status_code == 400, (body, answer.text)
        assert text in answer.json()["error"], (body, answer.text)
    # Over gRPC too: unload_dependents must be a bool_param.
    with grpc.insecure_channel(explicit.grpc_address) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        request = service_pb2.RepositoryModelUnloadRequest(model_name="ident")
        request.parameters["unload_dependents"].string_param = "yes"
        with pytest.raises(grpc.RpcError) as failure:
            stub.RepositoryModelUnload(request, timeout=30)
    assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "'unload_dependents' must be a boolean" in str(failure.value.details())
    infer = f"{explicit.url}/v2/models/ident/infer"
    assert httpx.post(infer, json=IDENT, timeout=30).status_code == 200  # still serving
