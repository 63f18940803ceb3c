"""Models loaded on demand (``--model-control-mode demand``, ``sluice.load``), evicted least
recently used within a measured memory budget, on one host and on two."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.http as httpclient
from prometheus_client.parser import text_string_to_metric_families
from redis import Redis

from sluice.client import Client
from sluice.core.keys import Keys
from sluice.core.on_demand import version_states
from sluice.scheduler.executor.redis_server import RedisServer
from tests.support import procs
from tests.support.model_files import python_config, tensor, write_model
from tests.support.onnx_models import write_identity
from tests.support.stack import Stack

MIB = 1 << 20
BUDGET = 80 * MIB
"""Room for two or three empty onnxruntime workers forked by the fork server (each holds
about 29 MiB of its own here): eight models never fit together, one always does (one
started on its own holds about 60 MiB)."""
MODELS = [f"m{index}" for index in range(8)]
REQUEST = {"inputs": [{"name": "IN_FP32", "datatype": "FP32", "shape": [1, 2], "data": [1, 2]}]}
X = [1, 2]
SLOW_INIT = """
import time

class Model:
    def __init__(self):
        time.sleep(4)

    def execute(self, inputs):
        return {"y": inputs["x"] * 2}
"""


def wait_until(predicate, timeout_s: float, interval_s: float = 0.1) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return False


def metrics(http: httpx.Client) -> dict[str, list[tuple[dict[str, str], float]]]:
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((sample.labels, sample.value))
    return samples


def index(http: httpx.Client) -> dict[str, dict[str, str]]:
    return {row["name"]: row for row in http.post("/v2/repository/index").json()}


@pytest.fixture(scope="module")
def batch_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the batch jobs of the demand stack read and write."""
    return tmp_path_factory.mktemp("demand-batches")


@pytest.fixture(scope="module")
def demand(tmp_path_factory: pytest.TempPathFactory, batch_root: Path) -> Iterator[Stack]:
    """Eight small models, every one on demand, in a budget that holds two or three; a
    batch worker beside them."""
    repository = tmp_path_factory.mktemp("demand")
    for name in MODELS:
        write_identity(repository, name, ["FP32"])
    stack = Stack(
        repository,
        None,
        env={
            "SLUICE_MEMORY_BUDGET": f"{BUDGET // MIB}MiB",
            "SLUICE_MIN_RESIDENCY_S": "0",
            "SLUICE_BATCH_ROOT": str(batch_root),
            "SLUICE_BATCH_STORE": "",
            "SLUICE_BATCH_WORKERS": "1",
        },
        args=["--model-control-mode", "demand"],
    )
    stack.start()
    try:
        yield stack
    finally:
        stack.stop()


def test_every_model_is_listed_and_ready_before_any_loads(demand: Stack) -> None:
    lines = "".join(demand.stdout_lines)
    for name in MODELS:
        assert f"model '{name}' version 1 loads on demand" in lines, lines
    with httpx.Client(base_url=demand.url, timeout=30) as http:
        rows = index(http)
        assert {rows[name]["state"] for name in MODELS} <= {"UNLOADED_ON_DEMAND", "READY"}
        assert http.get("/v2/health/ready").status_code == 200
    triton = httpclient.InferenceServerClient(demand.address)
    try:
        assert triton.is_server_ready()
        assert all(triton.is_model_ready(name) for name in MODELS)
        listed = {row["name"] for row in triton.get_model_repository_index(query_params=None)}
        assert listed >= set(MODELS)
    finally:
        triton.close()


def test_requests_load_their_models_and_the_least_used_make_room(demand: Stack) -> None:
    with httpx.Client(base_url=demand.url, timeout=60) as http:
        for name in [*MODELS, MODELS[0], MODELS[1]]:
            answer = http.post(f"/v2/models/{name}/infer", json=REQUEST)
            assert answer.status_code == 200, answer.text
            assert answer.json()["outputs"][0]["data"] == [1.0, 2.0]
        found = metrics(http)
        evicted = sum(v for labels, v in found["sluice_model_evictions_total"])
        assert evicted >= 1, found.get("sluice_model_evictions_total")
        reasons = {labels["reason"] for labels, v in found["sluice_model_evictions_total"] if v}
        assert reasons == {"budget"}
        cold = sum(v for _, v in found["sluice_model_cold_start_seconds_count"])
        assert cold >= len(MODELS) + 1, found["sluice_model_cold_start_seconds_count"]
        (budget,) = found["sluice_memory_budget_bytes"]
        assert budget[0]["device"] == "host" and budget[1] == BUDGET
        (used,) = found["sluice_memory_used_bytes"]
        assert 0 < used[1] <= BUDGET, used
        # (Which ones stay is the unit tests' matter: the least used go first, and the ones
        # asked for once go ahead of the next cold start.)
        states = [row["state"] for row in index(http).values()]
        assert "UNLOADED_ON_DEMAND" in states, states


def test_concurrent_requests_for_unloaded_models_are_all_answered(demand: Stack) -> None:
    """More models asked for at once than fit: some wait for another's eviction (its queue
    empty), none is lost."""

    def ask(index: int) -> int:
        with httpx.Client(base_url=demand.url, timeout=120) as http:
            name = MODELS[index % len(MODELS)]
            return http.post(f"/v2/models/{name}/infer", json=REQUEST).status_code

    with ThreadPoolExecutor(12) as pool:
        codes = list(pool.map(ask, range(24)))
    assert codes == [200] * 24


def test_load_and_unload_requests_are_refused_in_demand_mode(demand: Stack) -> None:
    with httpx.Client(base_url=demand.url, timeout=30) as http:
        answer = http.post(f"/v2/repository/models/{MODELS[0]}/load")
        assert answer.status_code == 503
        assert "not allowed" in answer.json()["error"]


def test_a_batch_job_loads_its_model_on_demand(demand: Stack, batch_root: Path) -> None:
    """A batch job on a model that is not loaded: its rows wait in the model's background
    stream while an executor loads it, and every one is answered."""
    with httpx.Client(base_url=demand.url, timeout=30) as http:
        rows = index(http)
    unloaded = [name for name in MODELS if rows[name]["state"] == "UNLOADED_ON_DEMAND"]
    assert unloaded, rows  # (eight models, room for two or three)
    data = np.arange(400, dtype=np.float32).reshape(200, 2)
    np.save(batch_root / "rows.npy", data)
    with Client(demand.url, timeout_s=60) as client:
        batch_id = client.submit_batch(
            unloaded[0], str(batch_root / "rows.npy"), str(batch_root / "out")
        )["id"]
        finished = ("completed", "failed", "cancelled")
        assert wait_until(lambda: client.batch(batch_id)["status"] in finished, 120, 0.25)
        state = client.batch(batch_id)
    assert state["status"] == "completed", state
    output = np.load(batch_root / "out" / batch_id / "OUT_FP32.npy")
    np.testing.assert_array_equal(output, data)


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """The default mode, with some models on demand by their parameter: ``lazy`` (small),
    ``huge`` (files larger than the budget), ``slowpoke`` (a Python model that takes 4 s to
    load), ``typo`` (a value of sluice.load that means nothing), ``plain`` (loaded at
    start), ``pinned`` (pinned: loaded at start)."""
    repository = tmp_path_factory.mktemp("mixed")
    on_demand = 'parameters { key: "sluice.load" value { string_value: "on_demand" } }'
    write_identity(repository, "plain", ["FP32"])
    write_identity(
        repository,
        "pinned",
        ["FP32"],
        extra='parameters { key: "sluice.pinned" value { string_value: "true" } }',
    )
    write_identity(repository, "lazy", ["FP32"], extra=on_demand)
    huge = write_identity(repository, "huge", ["FP32"], extra=on_demand)
    with open(huge / "1" / "weights.bin", "wb") as weights:
        weights.truncate(600 * MIB)  # (sparse: it takes no disk)
    write_identity(
        repository,
        "typo",
        ["FP32"],
        extra='parameters { key: "sluice.load" value { string_value: "sometimes" } }',
    )
    config = python_config([tensor("x", "TYPE_FP32", "2")], [tensor("y", "TYPE_FP32", "2")])
    write_model(repository, "slowpoke", f"{config}\n{on_demand}", {"1/model.py": SLOW_INIT})
    write_identity(repository, "stepped", ["FP32"], extra=on_demand)
    (repository / "via" / "1").mkdir(parents=True)
    (repository / "via" / "config.pbtxt").write_text(
        'name: "via"\nplatform: "ensemble"\nmax_batch_size: 8\n'
        'input [ { name: "X" data_type: TYPE_FP32 dims: [ -1 ] } ]\n'
        'output [ { name: "Y" data_type: TYPE_FP32 dims: [ -1 ] } ]\n'
        'ensemble_scheduling { step [ { model_name: "stepped" model_version: -1 '
        'input_map { key: "IN_FP32" value: "X" } output_map { key: "OUT_FP32" value: "Y" } '
        "} ] }\n"
    )
    stack = Stack(
        repository,
        None,
        env={"SLUICE_MEMORY_BUDGET": "500MiB", "SLUICE_FORK_SERVER": "false"},
    )
    stack.start()
    try:
        yield stack
    finally:
        stack.stop()


def test_an_ensemble_step_on_an_unloaded_model_loads_it(mixed: Stack) -> None:
    """The ensemble is loaded at start; its step's model loads on demand when the step's
    request is queued, as a client's would be."""
    with httpx.Client(base_url=mixed.url, timeout=60) as http:
        assert index(http)["stepped"]["state"] == "UNLOADED_ON_DEMAND"
        request = {"inputs": [{"name": "X", "datatype": "FP32", "shape": [1, 2], "data": X}]}
        answer = http.post("/v2/models/via/infer", json=request)
        assert answer.status_code == 200, answer.text
        assert answer.json()["outputs"][0]["data"] == [1.0, 2.0]
        # (The gateways read the hosts' states at their refresh: 2 s apart when idle.)
        assert wait_until(lambda: index(http)["stepped"]["state"] == "READY", 30)


def test_a_model_on_demand_by_its_parameter_loads_when_asked(mixed: Stack) -> None:
    with httpx.Client(base_url=mixed.url, timeout=60) as http:
        rows = index(http)
        assert rows["plain"]["state"] == "READY"
        assert rows["pinned"]["state"] == "READY"
        assert rows["lazy"]["state"] == "UNLOADED_ON_DEMAND"
        answer = http.post("/v2/models/lazy/infer", json=REQUEST)
        assert answer.status_code == 200, answer.text
        assert wait_until(lambda: index(http)["lazy"]["state"] == "READY", 30)


def test_a_model_larger_than_the_budget_is_refused_with_the_reason(mixed: Stack) -> None:
    """Every request that waited for it gets 503 with the reason, and so do later ones; an
    asynchronous job that waited for it fails with it."""

    def ask(_: int) -> httpx.Response:
        with httpx.Client(base_url=mixed.url, timeout=60) as http:
            return http.post("/v2/models/huge/infer", json=REQUEST)

    with httpx.Client(base_url=mixed.url, timeout=60) as http:
        job = http.post("/v2/models/huge/infer", json=REQUEST, headers={"Prefer": "respond-async"})
    assert job.status_code == 202, job.text
    with ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(ask, range(6)))
    for answer in [*answers, ask(0)]:
        assert answer.status_code == 503, answer.text
        assert "more than its whole SLUICE_MEMORY_BUDGET (500 MiB)" in answer.json()["error"]
    with httpx.Client(base_url=mixed.url, timeout=30) as http:
        assert wait_until(lambda: index(http)["huge"]["state"] == "UNAVAILABLE", 30)
        assert "SLUICE_MEMORY_BUDGET" in index(http)["huge"]["reason"]
        location = job.headers["location"]
        assert wait_until(lambda: http.get(location).json()["status"] == "failed", 30)
        result = http.get(f"{location}/result")
        assert result.status_code == 503, result.text
        assert "SLUICE_MEMORY_BUDGET" in result.json()["error"]


def test_a_bad_load_parameter_makes_the_model_unavailable_naming_it(mixed: Stack) -> None:
    with httpx.Client(base_url=mixed.url, timeout=30) as http:
        row = index(http)["typo"]
        assert row["state"] == "UNAVAILABLE"
        assert "sluice.load is 'sometimes'; it may be on_demand or always" in row["reason"]
        answer = http.post("/v2/models/typo/infer", json=REQUEST)
        # (Triton's answer to a model whose load failed, asked without a version)
        assert answer.status_code == 404, answer.text
        message = answer.json()["error"]
        assert message.startswith("Request for unknown model: 'typo' has no available versions")
        assert "sluice.load" in message


def test_a_worker_killed_while_loading_is_started_again_and_its_requests_kept(
    mixed: Stack,
) -> None:
    assert mixed.process is not None

    def loading() -> list[int]:
        return [
            pid
            for pid in procs.children(mixed.process.pid)  # type: ignore[union-attr]
            if "slowpoke" in procs.cmdline(pid)
        ]

    with ThreadPoolExecutor(1) as pool:
        asked = pool.submit(
            lambda: httpx.post(
                f"{mixed.url}/v2/models/slowpoke/infer",
                json={"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 2], "data": X}]},
                timeout=90,
            )
        )
        assert wait_until(lambda: bool(loading()), 20), "no worker started for slowpoke"
        (first,) = loading()
        os.kill(first, signal.SIGKILL)
        answer = asked.result(90)
    assert answer.status_code == 200, answer.text
    assert answer.json()["outputs"][0]["data"] == [2.0, 4.0]
    assert loading() and loading() != [first]


def test_a_budget_in_units_that_mean_nothing_stops_the_start(tmp_path: Path) -> None:
    write_identity(tmp_path, "m", ["FP32"])
    done = subprocess.run(
        [sys.executable, "-m", "sluice.cli", "up", "--model-repository", str(tmp_path)],
        env=dict(os.environ, SLUICE_MEMORY_BUDGET="12 parsecs", SLUICE_NAMESPACE="badunits"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    assert "SLUICE_MEMORY_BUDGET: '12 parsecs' is not a size" in done.stderr + done.stdout


def test_two_hosts_share_the_models_each_within_its_budget(tmp_path: Path) -> None:
    """Two executors (host ids a and b) on one Redis, each with room for one model (a
    worker started on its own holds about 60 MiB here: one fits in 90 MiB, two do not): the
    second model goes to the host with room, not over the first one's eviction; each
    version loads on one host only."""
    for name in ("left", "right"):
        write_identity(tmp_path, name, ["FP32"])
    redis_server = RedisServer()
    redis_server.start()
    env = {
        "SLUICE_MEMORY_BUDGET": "90MiB",
        "SLUICE_MIN_RESIDENCY_S": "0",
        "SLUICE_FORK_SERVER": "false",
    }
    first = Stack(
        tmp_path,
        redis_server.url,
        env={**env, "SLUICE_HOST_ID": "host-a"},
        args=["--model-control-mode", "demand"],
    )
    second: subprocess.Popen[bytes] | None = None
    try:
        first.start()
        second = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "sluice.cli",
                "up",
                "--model-repository",
                str(tmp_path),
                "--no-gateway",
                "--no-controller",
                "--model-control-mode",
                "demand",
            ],
            env=dict(
                os.environ,
                **env,
                SLUICE_HOST_ID="host-b",
                SLUICE_REDIS_URL=redis_server.url,
                SLUICE_NAMESPACE=first.namespace,
                SLUICE_BATCH_WORKERS="0",
            ),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        keys = Keys(first.namespace)
        redis = Redis.from_url(redis_server.url)
        assert wait_until(lambda: len(redis.hkeys(keys.host_memory)) == 2, 60)
        with httpx.Client(base_url=first.url, timeout=60) as http:
            for name in ("left", "right", "left", "right"):
                answer = http.post(f"/v2/models/{name}/infer", json=REQUEST)
                assert answer.status_code == 200, answer.text

        def placed() -> dict[str, str]:
            raw = redis.hgetall(keys.on_demand_states)
            hosts: dict[str, str] = {}
            for field in raw:
                host, model, _ = field.decode().split("/")
                hosts[model] = hosts.get(model, "") + host
            return hosts

        assert wait_until(lambda: sorted(placed().values()) == ["host-a", "host-b"], 10), placed()
        ready = {("left", 1): "READY", ("right", 1): "READY"}

        def states() -> dict[tuple[str, int], str]:
            return version_states(redis.hgetall(keys.on_demand_states), time.time())

        assert wait_until(lambda: states() == ready, 10), states()
        evictions = [
            redis.hget(keys.stats(name, 1), "evictions.budget") for name in ("left", "right")
        ]
        assert evictions == [None, None]
        redis.close()
    finally:
        if second is not None:
            second.terminate()
            second.wait(30)
        first.stop()
        redis_server.stop()
