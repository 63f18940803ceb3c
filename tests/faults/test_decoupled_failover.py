"""A decoupled model's worker killed (SIGKILL) mid-stream: the request is delivered to the
model's other worker and computed again from the start, and the client's stream goes on
where it stopped, each response once and in order, then the final one."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from redis import Redis

from tests.faults.conftest import FAST_FAILURE_DETECTION, Report, held_entries, live_workers
from tests.support import procs
from tests.support.stack import Stack

MODEL = "ticker"
STEPS = 8
KILL_AFTER = 3

TICKER = """
import time

import numpy as np


class Model:
    def stream(self, inputs):
        for step in range(int(inputs["COUNT"].reshape(-1)[0])):
            time.sleep(0.25)
            yield {"STEP": np.array([[step]], dtype=np.int32)}
"""

CONFIG = """
name: "ticker"
backend: "python"
max_batch_size: 1
input [ { name: "COUNT" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "STEP" data_type: TYPE_INT32 dims: [ 1 ] } ]
model_transaction_policy { decoupled: true }
instance_group [ { count: 2 kind: KIND_CPU } ]
"""


def kill_the_streaming_worker(redis: Redis, stack: Stack) -> int:
    """SIGKILL the worker that holds the stream's request; its pid."""
    assert stack.process is not None
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for pid in sorted(procs.worker_pids(stack.process.pid, MODEL)):
            if held_entries(redis, stack, pid, MODEL):
                os.kill(pid, signal.SIGKILL)
                return pid
        time.sleep(0.01)
    raise AssertionError("no worker held the stream's request within 10 s")


@pytest.mark.timeout(180)
def test_a_stream_whose_worker_dies_goes_on_where_it_stopped(
    tmp_path: Path,
    start_stack: Callable[..., Stack],
    redis_of: Callable[[Stack], Redis],
    report: Report,
) -> None:
    (tmp_path / MODEL / "1").mkdir(parents=True)
    (tmp_path / MODEL / "1" / "model.py").write_text(TICKER)
    (tmp_path / MODEL / "config.pbtxt").write_text(CONFIG)
    stack = start_stack(tmp_path, env=FAST_FAILURE_DETECTION)
    redis = redis_of(stack)
    assert procs.wait_until(lambda: live_workers(redis, stack, MODEL) >= 2, 60)

    steps: list[int] = []
    victim = 0
    started = time.monotonic()
    with (
        httpx.Client(base_url=stack.url, timeout=60) as http,
        http.stream("POST", f"/v2/models/{MODEL}/generate_stream", json={"COUNT": STEPS}) as sse,
    ):
        assert sse.status_code == 200
        for line in sse.iter_lines():
            if not line.startswith("data: "):
                continue
            event: dict[str, Any] = orjson.loads(line.removeprefix("data: "))
            assert "error" not in event, event
            steps.append(event["STEP"])
            if len(steps) == KILL_AFTER:
                victim = kill_the_streaming_worker(redis, stack)
    report({"steps": steps, "seconds": round(time.monotonic() - started, 2)})
    assert victim and not procs.alive(victim)
    assert steps == list(range(STEPS)), "a response came twice, or went missing"
