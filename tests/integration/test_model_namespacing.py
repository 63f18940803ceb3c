"""``sluice up --model-repository A --model-repository B --model-namespacing=true``, as
Triton's L0_model_namespacing runs tritonserver: both repositories hold a composing model
``comp`` and an ensemble ``pipe`` calling it, each one's answer its own (A's doubles, B's
triples); each repository's ensembles call their own repository's ``comp``; a request
naming ``comp`` or ``pipe`` is refused with Triton's ambiguity error; the index lists each
copy; a load or unload of such a name applies to every copy; and in poll mode, a ``comp``
taken from A makes every ensemble call B's, until it is back."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import cast

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from prometheus_client.parser import text_string_to_metric_families
from redis import Redis
from tritonclient.utils import InferenceServerException

from sluice.core.catalog_applied import lagging_gateways
from sluice.core.control import live_executors
from sluice.core.keys import Keys
from sluice.scheduler.executor.redis_server import RedisServer
from tests.support.model_files import python_config, tensor, write_model
from tests.support.procs import wait_until
from tests.support.stack import Stack

AMBIGUOUS = (
    "There are 2 identifiers of model '{}' in global map, model namespace must be provided "
    "to resolve ambiguity."
)

UNKNOWN = "Request for unknown model: '{}' is not found"

_TIMES = """
class Model:
    def execute(self, inputs):
        return {{"y": inputs["x"] * {factor}}}
"""

_PIPE = """
platform: "ensemble"
max_batch_size: 8
input [ { name: "X" data_type: TYPE_FP32 dims: [ 2 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ 2 ] } ]
ensemble_scheduling {
  step [
    { model_name: "comp" model_version: -1
      input_map { key: "x" value: "X" } output_map { key: "y" value: "Y" } }
  ]
}
"""

_DATA = np.array([[1.0, 2.0]], dtype=np.float32)


def _write_comp(repository: Path, factor: int) -> None:
    config = python_config([tensor("x", "TYPE_FP32", "2")], [tensor("y", "TYPE_FP32", "2")])
    write_model(repository, "comp", config, {"1/model.py": _TIMES.format(factor=factor)})


def _repositories(tmp_path: Path) -> tuple[Path, Path]:
    """A: ``comp`` doubles, ``pipe`` and ``via_a`` call it; B: ``comp`` triples, ``pipe``
    and ``via_b`` call it."""
    first, second = tmp_path / "addsub_repo", tmp_path / "subadd_repo"
    for repository, factor, own in ((first, 2, "via_a"), (second, 3, "via_b")):
        _write_comp(repository, factor)
        for name in ("pipe", own):
            write_model(repository, name, _PIPE)
            (repository / name / "1").mkdir()
    return first, second


def _stack(tmp_path: Path, redis_url: str, *args: str) -> Stack:
    first, second = _repositories(tmp_path)
    return Stack(
        first,
        redis_url,
        env={"SLUICE_REPOSITORY_CACHE_DIR": str(tmp_path / "cache")},
        args=[f"--model-repository={second}", "--model-namespacing=true", *args],
    )


def _joining_executor(stack: Stack, tmp_path: Path) -> subprocess.Popen[bytes]:
    """``sluice up --no-gateway --no-controller`` on the stack's Redis, namespace and
    repositories (explicit mode): another host joining the deployment, or the executor
    started again beside the others."""
    env = dict(
        os.environ,
        SLUICE_REDIS_URL=stack.redis_url or "",
        SLUICE_NAMESPACE=stack.namespace,
        SLUICE_BATCH_WORKERS="0",
        SLUICE_REPOSITORY_CACHE_DIR=str(tmp_path / "joining-cache"),
    )
    argv = [sys.executable, "-m", "sluice.cli", "up", "--no-gateway", "--no-controller"]
    argv += [f"--model-repository={tmp_path / name}" for name in ("addsub_repo", "subadd_repo")]
    argv += ["--model-namespacing=true", "--model-control-mode=explicit"]
    return subprocess.Popen(
        argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )


def _revision(client: Redis, keys: Keys) -> int:
    return int(cast(bytes, client.get(keys.catalog_revision)))


def _times(stack: Stack, model: str) -> float:
    """By how much ``model`` multiplies (tritonclient, HTTP)."""
    given, wanted = ("x", "y") if model == "comp" else ("X", "Y")
    with httpclient.InferenceServerClient(stack.address) as client:
        tensor = httpclient.InferInput(given, list(_DATA.shape), "FP32")
        tensor.set_data_from_numpy(_DATA)
        result = client.infer(model, [tensor]).as_numpy(wanted)
    assert result is not None
    return float(result[0][0] / _DATA[0][0])


def _refusal(stack: Stack, model: str) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as caught:
        _times(stack, model)
    return caught.value


def _index(http: httpx.Client) -> list[tuple[str, str]]:
    rows = http.post("/v2/repository/index", json={}).json()
    return sorted((row["name"], row.get("state", "")) for row in rows)


def _labelled_copies(metrics: str) -> set[tuple[str, str]]:
    """(model, namespace) of Triton's success counter's series that have a namespace (with
    namespacing, every one); no series of any family names a copy by Sluice's internal
    name, and Sluice's families label the models as Triton's do."""
    families = {f.name: f for f in text_string_to_metric_families(metrics)}
    for family in families.values():
        assert not any("@" in sample.labels.get("model", "") for sample in family.samples)

    def labelled(name: str) -> set[tuple[str, str]]:
        return {
            (sample.labels["model"], sample.labels["namespace"])
            for sample in families[name].samples
            if "namespace" in sample.labels
        }

    assert labelled("sluice_consumer_lag") == labelled("nv_inference_request_success")
    return labelled("nv_inference_request_success")


def test_each_repository_is_a_namespace(tmp_path: Path, redis_server: RedisServer) -> None:
    stack = _stack(tmp_path, redis_server.url)
    stack.start()
    try:
        assert _times(stack, "via_a") == 2  # A's ensemble calls A's comp
        assert _times(stack, "via_b") == 3  # B's, B's
        for name in ("comp", "pipe"):
            refused = _refusal(stack, name)
            assert (refused.status(), refused.message()) == ("400", AMBIGUOUS.format(name))
        with grpcclient.InferenceServerClient(stack.grpc_address) as client:
            tensor = grpcclient.InferInput("X", list(_DATA.shape), "FP32")
            tensor.set_data_from_numpy(_DATA)
            with pytest.raises(InferenceServerException) as caught:
                client.infer("comp", [tensor])
            assert caught.value.status() == "StatusCode.INVALID_ARGUMENT"
            assert caught.value.message() == AMBIGUOUS.format("comp")
            assert not client.is_model_ready("comp")
            assert client.is_server_ready()
            with pytest.raises(InferenceServerException) as caught:
                client.get_model_metadata("nope")  # Triton's 400 for an unknown name
            assert caught.value.status() == "StatusCode.INVALID_ARGUMENT"
            assert caught.value.message() == UNKNOWN.format("nope")
            assert not client.is_model_ready("nope")
        refused = _refusal(stack, "nope")
        assert (refused.status(), refused.message()) == ("400", UNKNOWN.format("nope"))
        with httpx.Client(base_url=stack.url, timeout=30) as http:
            assert _index(http) == [
                ("comp", "READY"),
                ("comp", "READY"),
                ("pipe", "READY"),
                ("pipe", "READY"),
                ("via_a", "READY"),
                ("via_b", "READY"),
            ]
            metadata = http.get("/v2/models/comp")
            assert (metadata.status_code, metadata.json()) == (
                400,
                {"error": AMBIGUOUS.format("comp")},
            )
            internal = http.get("/v2/models/comp@1")  # Sluice's own name: unknown
            assert (internal.status_code, internal.json()) == (
                400,
                {"error": UNKNOWN.format("comp@1")},
            )
            assert http.get("/v2/models/nope/ready").status_code == 404  # (as without)
            assert http.get("/v2/health/ready").status_code == 200
            listed = http.get("/models").json()["models"]  # TorchServe's management API
            assert [row["modelName"] for row in listed] == ["comp", "pipe", "via_a", "via_b"]
            described = http.get("/models/comp")
            assert (described.status_code, described.json()["message"]) == (
                400,
                AMBIGUOUS.format("comp"),
            )
            first, second = str(tmp_path / "addsub_repo"), str(tmp_path / "subadd_repo")
            assert _labelled_copies(http.get("/metrics").text) == {
                ("comp", first),
                ("comp", second),
                ("pipe", first),
                ("pipe", second),
                ("via_a", first),
                ("via_b", second),
            }
            missing = http.get("/v2/models/via_b/versions/9")  # named by its repository too
            assert (missing.status_code, missing.json()) == (
                404,
                {"error": f"Request for unknown model: '{second}::via_b' version 9 is not found"},
            )
    finally:
        stack.stop()


def test_a_load_or_unload_of_a_name_held_twice_applies_to_each_copy(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    stack = _stack(tmp_path, redis_server.url, "--model-control-mode=explicit")
    stack.start()
    try:
        with httpx.Client(base_url=stack.url, timeout=120) as http:
            loaded = http.post("/v2/repository/models/pipe/load")
            assert loaded.status_code == 200, loaded.text
            ready = [name for name, state in _index(http) if state == "READY"]
            assert ready == ["comp", "comp", "pipe", "pipe"]  # each pipe, each its comp
            assert http.post("/v2/repository/models/via_b/load").status_code == 200
            assert _times(stack, "via_b") == 3
            unloaded = http.post(
                "/v2/repository/models/pipe/unload",
                json={"parameters": {"unload_dependents": True}},
            )
            assert unloaded.status_code == 200, unloaded.text
            ready = [name for name, state in _index(http) if state == "READY"]
            assert ready == ["comp", "via_b"]  # B's comp stays: via_b calls it
            internal = http.post("/v2/repository/models/comp@1/load")
            assert internal.status_code == 400
            assert internal.json() == {
                "error": "failed to load 'comp@1', failed to poll from model repository"
            }
            never = http.get("/v2/models/via_a")  # never loaded: unknown, as in Triton
            assert (never.status_code, never.json()) == (400, {"error": UNKNOWN.format("via_a")})
            assert http.post("/v2/repository/models/via_b/unload").status_code == 200
            gone = http.get("/v2/models/via_b")  # loaded once: known, with no model
            assert (gone.status_code, gone.json()) == (
                404,
                {"error": "Identifier of model 'via_b' is not found in global map"},
            )

            # An executor that joins (one started again beside the others) publishes the
            # catalog knowing what they know: via_b is still a model loaded once.
            client, keys = Redis.from_url(stack.redis_url or ""), Keys(stack.namespace)
            before = _revision(client, keys)
            joining = _joining_executor(stack, tmp_path)
            try:
                assert wait_until(lambda: len(live_executors(client, keys)) == 2, 120)
                # (it publishes twice as it starts: first what it loads, then everything)
                assert wait_until(lambda: _revision(client, keys) >= before + 2, 120)
                revision = _revision(client, keys)
                assert wait_until(lambda: not lagging_gateways(client, keys, revision), 60)
                again = http.get("/v2/models/via_b")
                assert again.status_code == 404, again.text
                assert http.get("/v2/models/via_a").status_code == 400  # (never loaded)
            finally:
                os.killpg(joining.pid, signal.SIGTERM)
                joining.wait(60)
                client.close()
    finally:
        stack.stop()


def test_poll_mode_resolves_the_ensembles_again_as_the_repositories_change(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    stack = _stack(tmp_path, redis_server.url, "--model-control-mode=poll")
    stack.args.append("--repository-poll-secs=1")
    stack.start()
    first = tmp_path / "addsub_repo"
    try:
        assert _times(stack, "via_a") == 2
        shutil.move(first / "comp", tmp_path / "comp")  # A's comp gone: B's is the one

        def resolved(model: str, factor: float) -> bool:
            try:
                return _times(stack, model) == factor
            except InferenceServerException:
                return False

        assert wait_until(lambda: resolved("via_a", 3) and resolved("comp", 3), 90)
        assert _refusal(stack, "pipe").message() == AMBIGUOUS.format("pipe")  # still both
        shutil.move(tmp_path / "comp", first / "comp")  # back

        def ambiguous_again() -> bool:
            try:
                _times(stack, "comp")
            except InferenceServerException as exc:
                return AMBIGUOUS.format("comp") in exc.message()
            return False

        # (Every model is loaded again: via_b's ensemble, resolved while B's comp was the one
        # comp, calls the bare name until its new version replaces it.)
        assert wait_until(
            lambda: ambiguous_again() and resolved("via_a", 2) and resolved("via_b", 3), 90
        )
    finally:
        stack.stop()
