"""On-demand loads against misbehaving workers: a load that hangs is abandoned at its
deadline, and a worker that ignores SIGTERM when its model is unloaded is killed after its
grace, so that the model it made room for loads. Real workers, real Redis, small timeouts."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from redis import Redis

from sluice.core.keys import Keys
from tests.support import procs
from tests.support.model_files import write_model
from tests.support.onnx_models import write_identity
from tests.support.stack import Stack
from tests.support.stubborn_models import CONFIG, REQUEST, model_source, pid_in

MIB = 1 << 20
LOAD_TIMEOUT_S = 10
"""Long enough for the test to see the load under way (a worker forked by the fork server
writes its pid within a second on a busy machine, and the gateways read the hosts' states
every half second while a request waits), short for a test."""
STOP_GRACE_S = 1
ONNX_REQUEST = {
    "inputs": [{"name": "IN_FP32", "datatype": "FP32", "shape": [1, 2], "data": [1, 2]}]
}


def _index(http: httpx.Client) -> dict[str, dict[str, str]]:
    return {row["name"]: row for row in http.post("/v2/repository/index").json()}


@pytest.mark.timeout(180)
def test_a_load_that_hangs_is_abandoned_at_its_deadline(
    tmp_path: Path, start_stack: Callable[..., Stack]
) -> None:
    """A Python model whose loading never ends: at ``SLUICE_ON_DEMAND_LOAD_TIMEOUT_S`` its
    worker is killed, its waiting request answered 503 with the reason (as later ones
    are), and the room it held goes to the model waiting for it (the budget holds one of
    the two, as estimated before either was measured)."""
    repository = tmp_path / "models"
    pid_file = tmp_path / "hangs.pid"
    write_model(repository, "hangs", CONFIG, {"1/model.py": model_source(pid_file, hangs=True)})
    write_identity(repository, "quick", ["FP32"])
    stack = start_stack(
        repository,
        env={
            "SLUICE_MODEL_CONTROL_MODE": "demand",
            "SLUICE_MEMORY_BUDGET": "200MiB",
            "SLUICE_ON_DEMAND_LOAD_TIMEOUT_S": str(LOAD_TIMEOUT_S),
        },
    )
    # (The fork server starts once the stack is ready: a load before it has done its imports
    # starts a process of its own, whose imports take seconds of the load's deadline.)
    ready = "the fork server has done its imports"
    assert procs.wait_until(lambda: ready in "".join(stack.stderr_lines), 60), "no fork server"
    with ThreadPoolExecutor(2) as pool, httpx.Client(base_url=stack.url, timeout=60) as http:
        sent = time.monotonic()
        hung = pool.submit(http.post, "/v2/models/hangs/infer", json=REQUEST)
        assert procs.wait_until(lambda: pid_in(pid_file) is not None, 30), "no worker for hangs"
        worker = pid_in(pid_file)
        assert worker is not None
        # (The gateways read the hosts' states every refresh: not at once.)
        assert procs.wait_until(lambda: _index(http)["hangs"]["state"] != "UNLOADED_ON_DEMAND", 30)
        assert _index(http)["hangs"]["state"] == "LOADING"
        waiting = pool.submit(http.post, "/v2/models/quick/infer", json=ONNX_REQUEST)

        answer = hung.result(60)
        waited_s = time.monotonic() - sent
        assert answer.status_code == 503, answer.text
        error = answer.json()["error"]
        assert "model 'hangs' version 1 is unavailable" in error, error
        assert f"not ready within {LOAD_TIMEOUT_S} s" in error, error
        assert "SLUICE_ON_DEMAND_LOAD_TIMEOUT_S" in error, error
        assert waited_s < LOAD_TIMEOUT_S + 20, waited_s
        assert procs.wait_until(lambda: not procs.alive(worker), 5), "its worker still runs"

        # The room it held is given back: the model that waited for it loads.
        answer = waiting.result(60)
        assert answer.status_code == 200, answer.text

        later = http.post("/v2/models/hangs/infer", json=REQUEST)
        assert later.status_code == 503, later.text
        assert "SLUICE_ON_DEMAND_LOAD_TIMEOUT_S" in later.json()["error"]
        # (The gateways read the states at their refresh: 2 s apart when idle.)
        assert procs.wait_until(lambda: _index(http)["hangs"]["state"] == "UNAVAILABLE", 30)
        assert "SLUICE_ON_DEMAND_LOAD_TIMEOUT_S" in _index(http)["hangs"]["reason"]


@pytest.mark.timeout(180)
def test_a_worker_that_ignores_sigterm_is_killed_to_make_room(
    tmp_path: Path, start_stack: Callable[..., Stack]
) -> None:
    """The budget holds one of two models of about 190 MiB each. The first one's worker
    ignores SIGTERM; when the second one needs its room, the first is unloaded, killed
    after ``SLUICE_ON_DEMAND_STOP_GRACE_S``, and the second loads once it is gone."""
    repository = tmp_path / "models"
    stubborn_pid, successor_pid = tmp_path / "stubborn.pid", tmp_path / "successor.pid"
    for name, ignores_sigterm, pid_file in (
        ("stubborn", True, stubborn_pid),
        ("successor", False, successor_pid),
    ):
        source = model_source(pid_file, ignores_sigterm=ignores_sigterm, ballast_mib=150)
        write_model(repository, name, CONFIG, {"1/model.py": source})
    stack = start_stack(
        repository,
        env={
            "SLUICE_MODEL_CONTROL_MODE": "demand",
            "SLUICE_MEMORY_BUDGET": "250MiB",
            "SLUICE_MIN_RESIDENCY_S": "0",
            "SLUICE_ON_DEMAND_STOP_GRACE_S": str(STOP_GRACE_S),
        },
    )
    assert stack.redis_url is not None
    keys = Keys(stack.namespace)
    redis = Redis.from_url(stack.redis_url)
    try:
        with httpx.Client(base_url=stack.url, timeout=60) as http:
            answer = http.post("/v2/models/stubborn/infer", json=REQUEST)
            assert answer.status_code == 200, answer.text
            # Measured (so the second one is known not to fit beside it).
            assert procs.wait_until(lambda: redis.hexists(keys.model_memory, "stubborn:1"), 30)
            held = json.loads(redis.hget(keys.model_memory, "stubborn:1") or b"{}")["host"]
            assert 150 * MIB < held <= 250 * MIB, f"one fits the budget, two do not: {held}"
            stubborn = pid_in(stubborn_pid)
            assert stubborn is not None and procs.alive(stubborn)

            asked = time.monotonic()
            answer = http.post("/v2/models/successor/infer", json=REQUEST, timeout=30)
            took_s = time.monotonic() - asked
            assert answer.status_code == 200, answer.text
            assert not procs.alive(stubborn), "the worker that ignored SIGTERM still runs"
            assert took_s >= STOP_GRACE_S, took_s  # (it did wait for the kill)
            assert redis.hget(keys.stats("stubborn", 1), "evictions.budget") == b"1"
        log = "".join(stack.stderr_lines)
        assert f"did not exit within {STOP_GRACE_S} s of SIGTERM; killing it (SIGKILL)" in log
    finally:
        redis.close()
