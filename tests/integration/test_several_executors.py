"""Several executors (``sluice up``, one per host) on one Redis: every load and unload is
carried out by each of them, and answered once each executor alive when it was sent has
answered; an executor killed meanwhile is waited for only until its place among the live
executors runs out."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
from redis import Redis

from sluice.core.control import EXECUTOR_TTL_S, live_executors
from sluice.core.keys import Keys
from sluice.scheduler.executor.redis_server import RedisServer
from tests.support.onnx_models import write_identity
from tests.support.procs import wait_until
from tests.support.stack import Stack


def _second_executor(stack: Stack, repository: Path) -> subprocess.Popen[bytes]:
    """``sluice up --no-gateway --no-controller`` on the stack's Redis and namespace: a
    second worker host, as docs/operations/several-hosts.md lays it out."""
    env = dict(
        os.environ,
        SLUICE_REDIS_URL=stack.redis_url or "",
        SLUICE_NAMESPACE=stack.namespace,
        SLUICE_BATCH_WORKERS="0",
    )
    argv = [sys.executable, "-m", "sluice.cli", "up", "--model-repository", str(repository)]
    argv += ["--no-gateway", "--no-controller", "--model-control-mode=explicit"]
    argv += ["--load-model=ident"]
    return subprocess.Popen(
        argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )


def _first_executor(tmp_path: Path, redis_server: RedisServer, *more: str) -> tuple[Path, Stack]:
    """A repository of ``ident``, ``other`` and ``more`` models, and ``sluice up`` serving it
    in explicit mode with ``ident`` loaded (started)."""
    repository = tmp_path / "repository"
    for name in ("ident", "other", *more):
        write_identity(repository, name, ["FP32"])
    args = ["--model-control-mode=explicit", "--load-model=ident"]
    stack = Stack(repository, redis_server.url, grpc_port=0, args=args)
    stack.start()
    return repository, stack


def _live_workers(client: Redis, keys: Keys, model: str) -> int:
    return int(client.zcount(keys.live_workers(model, 1), time.time(), "+inf"))


def test_each_executor_loads_and_unloads_and_a_dead_one_is_not_waited_for(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    repository, stack = _first_executor(tmp_path, redis_server)
    keys = Keys(stack.namespace)
    client = Redis.from_url(redis_server.url)
    second = _second_executor(stack, repository)

    try:
        assert wait_until(lambda: len(live_executors(client, keys)) == 2, 60)
        assert wait_until(lambda: _live_workers(client, keys, "ident") == 2, 60)
        with httpx.Client(base_url=stack.url, timeout=120) as http:
            loaded = http.post("/v2/repository/models/other/load")
            assert loaded.status_code == 200, loaded.text
            assert _live_workers(client, keys, "other") == 2  # one on each executor's host, ready
            unloaded = http.post("/v2/repository/models/other/unload")
            assert unloaded.status_code == 200, unloaded.text
            assert wait_until(lambda: _live_workers(client, keys, "other") == 0, 10)

            os.killpg(second.pid, signal.SIGKILL)  # the host dies: it never leaves
            second.wait()
            assert len(live_executors(client, keys)) == 2  # (its place has not run out)
            started = time.monotonic()
            again = http.post("/v2/repository/models/other/load")
            assert again.status_code == 200, again.text
            # Answered once the dead executor's place ran out, not after the load's timeout.
            assert time.monotonic() - started < 60
            assert len(live_executors(client, keys)) == 1
            assert wait_until(lambda: _live_workers(client, keys, "other") == 1, 3 * EXECUTOR_TTL_S)
    finally:
        if second.poll() is None:
            os.killpg(second.pid, signal.SIGTERM)
            second.wait(30)
        client.close()
        stack.stop()


@dataclass
class _Joining:
    """A first executor serving, and a second one that joins when the test says so."""

    repository: Path
    stack: Stack
    client: Redis
    keys: Keys
    second: subprocess.Popen[bytes] | None = None

    def join(self) -> None:
        self.second = _second_executor(self.stack, self.repository)
        assert wait_until(lambda: len(live_executors(self.client, self.keys)) == 2, 60)


@contextlib.contextmanager
def _joining(tmp_path: Path, redis_server: RedisServer, *more: str) -> Iterator[_Joining]:
    repository, stack = _first_executor(tmp_path, redis_server, *more)
    hosts = _Joining(repository, stack, Redis.from_url(redis_server.url), Keys(stack.namespace))
    try:
        yield hosts
    finally:
        if hosts.second is not None and hosts.second.poll() is None:
            os.killpg(hosts.second.pid, signal.SIGTERM)
            hosts.second.wait(30)
        hosts.client.close()
        stack.stop()


def test_an_executor_that_joins_serves_what_the_others_loaded(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """Explicit mode: a load made before a host joined is served by that host too (it
    starts with what the catalog says is loaded, not only its --load-model), and the
    catalog it publishes keeps the model ready."""
    with (
        _joining(tmp_path, redis_server, "never") as hosts,
        httpx.Client(base_url=hosts.stack.url, timeout=120) as http,
    ):
        client, keys = hosts.client, hosts.keys
        loaded = http.post("/v2/repository/models/other/load")
        assert loaded.status_code == 200, loaded.text
        hosts.join()
        assert wait_until(lambda: _live_workers(client, keys, "other") == 2, 60)
        assert _live_workers(client, keys, "never") == 0
        states = {row["name"]: row.get("state") for row in http.post("/v2/repository/index").json()}
        assert states["other"] == "READY" and states["ident"] == "READY", states
        assert http.get("/v2/models/other/ready").status_code == 200


def test_an_executor_that_joins_loads_each_model_as_the_others_did(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """Explicit mode: ``other`` was loaded with a configuration of its own (two instances)
    and ``uploaded`` from a request's files alone (the repository has no such model); a
    host that joins later serves both as the first host does. An unload forgets how."""
    with (
        _joining(tmp_path, redis_server) as hosts,
        httpx.Client(base_url=hosts.stack.url, timeout=120) as http,
    ):
        client, keys = hosts.client, hosts.keys
        onnx = (hosts.repository / "ident" / "1" / "model.onnx").read_bytes()

        def config(name: str, count: int) -> str:
            template = http.get("/v2/models/ident/config").json()
            template.update(name=name, instance_group=[{"count": count, "kind": "KIND_CPU"}])
            return json.dumps(template)

        two = {"parameters": {"config": config("other", 2)}}
        loaded = http.post("/v2/repository/models/other/load", json=two)
        assert loaded.status_code == 200, loaded.text
        files = {
            "config": config("uploaded", 1),
            "file:1/model.onnx": base64.b64encode(onnx).decode(),
        }
        uploaded = http.post("/v2/repository/models/uploaded/load", json={"parameters": files})
        assert uploaded.status_code == 200, uploaded.text
        hosts.join()
        assert wait_until(lambda: _live_workers(client, keys, "other") == 4, 60)
        assert wait_until(lambda: _live_workers(client, keys, "uploaded") == 2, 60)
        body = {
            "inputs": [{"name": "IN_FP32", "shape": [1, 2], "datatype": "FP32", "data": [1, 2]}]
        }
        for _ in range(8):  # (either host's worker answers)
            answer = http.post("/v2/models/uploaded/infer", json=body)
            assert answer.status_code == 200, answer.text

        assert http.post("/v2/repository/models/other/unload").status_code == 200
        assert client.hget(keys.loaded_as, "other") is None
        assert client.hget(keys.loaded_as, "uploaded") is not None
