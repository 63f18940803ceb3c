"""Requests of a higher priority level are served before queued lower-priority ones."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import orjson
from redis import Redis

from sluice.core.keys import Keys
from tests.support import procs
from tests.support.load import slow_request
from tests.support.slow_model import write_slow
from tests.support.stack import Stack

PRIORITIES = (
    "dynamic_batching { priority_levels: 2 default_priority_level: 2 }\n"
    "instance_group [ { count: 1 kind: KIND_CPU } ]"
)


def test_high_priority_overtakes_queued_low_priority(
    tmp_path: Path, start_stack: Callable[..., Stack]
) -> None:
    write_slow(tmp_path, "slow", max_batch_size=1, extra=PRIORITIES)
    stack = start_stack(tmp_path)
    finished: list[str] = []
    lock = threading.Lock()

    def send(name: str, iters: int, priority: int | None) -> None:
        body = slow_request(0, iters)
        if priority is not None:
            body["parameters"] = {"priority": priority}
        with httpx.Client(base_url=stack.url, timeout=60) as http:
            response = http.post("/v2/models/slow/infer", content=orjson.dumps(body))
        assert response.status_code == 200, response.text
        with lock:
            finished.append(name)

    with httpx.Client(base_url=stack.url, timeout=60) as http:
        # As in Triton, a priority past the model's levels takes the default level.
        beyond = http.post(
            "/v2/models/slow/infer",
            content=orjson.dumps({**slow_request(0), "parameters": {"priority": 3}}),
        )
        assert beyond.status_code == 200, beyond.text

        started = time.monotonic()
        assert (
            http.post(
                "/v2/models/slow/infer", content=orjson.dumps(slow_request(0, 20_000))
            ).status_code
            == 200
        )
        per_iter = max(time.monotonic() - started, 0.001) / 20_000
    # (Five seconds on the machine as calibrated: one that runs three times faster a moment
    # later still holds the low ones queued behind it while they are counted.)
    blocker_iters = int(5.0 / per_iter)
    short_iters = max(1, int(0.1 / per_iter))

    assert stack.redis_url is not None
    redis = Redis.from_url(stack.redis_url)
    low = Keys(stack.namespace).request_streams("slow", 1, 2)[1]
    threads = [threading.Thread(target=send, args=("blocker", blocker_iters, None))]
    threads[0].start()
    # The blocker first in the default level's stream (the worker takes it at once).
    assert procs.wait_until(lambda: redis.xlen(low) >= 1, 30), "the blocker never queued"
    for index in range(6):
        threads.append(threading.Thread(target=send, args=(f"low{index}", short_iters, 2)))
        threads[-1].start()
        time.sleep(0.02)
    # The six low ones wait behind the blocker (in the same stream, the default level's)
    # before the high one comes: a busy machine may take a while to queue them.
    assert procs.wait_until(lambda: redis.xlen(low) >= 7, 10), redis.xlen(low)
    redis.close()
    threads.append(threading.Thread(target=send, args=("high", short_iters, 1)))
    threads[-1].start()
    for thread in threads:
        thread.join(90)
    assert len(finished) == 8
    assert finished[0] == "blocker"
    # At most the one low-priority request already taken for the next batch goes first.
    assert finished.index("high") <= 2, finished
