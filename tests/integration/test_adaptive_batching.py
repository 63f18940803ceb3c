"""Adaptive batching on a running stack: a lone request does not wait out
``max_queue_delay_microseconds`` (unless the config turns adaptive batching off),
requests go in deadline order, and a request that cannot make its deadline is answered
at once without computing."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from redis import Redis

from sluice.core.keys import Keys
from sluice.scheduler.executor.redis_server import RedisServer
from tests.integration.test_metrics import scrape
from tests.support.model_files import python_config, tensor, write_model
from tests.support.procs import wait_until
from tests.support.stack import Stack

SEQUENCED = """
    import itertools
    import time

    import numpy as np

    CALLS = itertools.count(1)


    class Model:
        def execute(self, inputs):
            x = inputs["x"]
            time.sleep(float(x[:, 0].max()))
            y = x.copy()
            y[:, 0] = next(CALLS)
            return {"y": y}
"""
"""``x[:, 0]``: seconds the batch sleeps; ``y[:, 0]``: the batch's place in the order the
instance computed them; ``y[:, 1]`` is ``x[:, 1]``."""

WINDOW_US = 20_000
IO = [tensor("x", "TYPE_FP32", "2")], [tensor("y", "TYPE_FP32", "2")]
FIXED = 'parameters { key: "adaptive_batching" value: { string_value: "false" } }'


def _batching(extra: str = "") -> str:
    return f"dynamic_batching {{ max_queue_delay_microseconds: {WINDOW_US} }}\n{extra}"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer) -> Iterator[Stack]:
    root: Path = tmp_path_factory.mktemp("adaptive")
    files = {"1/model.py": SEQUENCED}
    write_model(root, "adaptive", python_config(*IO, extra=_batching()), files)
    write_model(root, "fixed", python_config(*IO, extra=_batching(FIXED)), files)
    single = python_config(*IO, max_batch_size=1, extra=_batching())
    write_model(root, "ordered", single, files)
    write_model(root, "hopeless", single, files)
    stack = Stack(root, redis_server.url)
    stack.start()
    yield stack
    stack.stop()


@pytest.fixture(scope="module")
def http(stack: Stack) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=stack.url, timeout=60) as client:
        yield client


def _infer(
    http: httpx.Client, model: str, sleep_s: float, marker: float, **parameters: Any
) -> httpx.Response:
    body: dict[str, Any] = {
        "inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [sleep_s, marker]}]
    }
    if parameters:
        body["parameters"] = parameters
    return http.post(f"/v2/models/{model}/infer", json=body)


def _order(response: httpx.Response) -> float:
    assert response.status_code == 200, response.text
    return float(response.json()["outputs"][0]["data"][0])


def _queue_ms(http: httpx.Client, model: str) -> float:
    stats = http.get(f"/v2/models/{model}/stats").json()["model_stats"][0]["inference_stats"]
    return stats["queue"]["ns"] / stats["queue"]["count"] / 1e6


def test_a_lone_request_goes_at_once_unless_the_config_asks_for_the_fixed_window(
    http: httpx.Client,
) -> None:
    for model in ("adaptive", "fixed"):
        for i in range(10):
            assert _infer(http, model, 0.0, i).status_code == 200
    samples = scrape(http)
    assert samples[("sluice_batch_closes", "adaptive", "1", "adaptive")] >= 9
    assert samples[("sluice_batch_closes", "fixed", "1", "window")] == 10
    assert samples[("sluice_batch_closes", "fixed", "1", "adaptive")] == 0
    assert samples[("sluice_batch_wait_seconds_count", "adaptive", "1", "")] >= 10
    # The fixed window makes every lone request wait it out; adaptive batching does not
    # (the worker's own measure of each batch's wait: a request's whole time in the queue
    # also holds the hops to the worker, which a busy machine lengthens).
    assert _queue_ms(http, "fixed") >= WINDOW_US / 1000
    waited_s = samples[("sluice_batch_wait_seconds_sum", "adaptive", "1", "")]
    batches = samples[("sluice_batch_wait_seconds_count", "adaptive", "1", "")]
    # (The first batch may close on the window, before the worker knows the arrival rate:
    # it may wait the whole window; every other batch a tenth of it at most.)
    others = batches - samples[("sluice_batch_closes", "adaptive", "1", "adaptive")]
    assert waited_s < (others + batches / 10) * WINDOW_US / 1e6, (waited_s, others)


def test_concurrent_requests_still_share_batches(http: httpx.Client, stack: Stack) -> None:
    with httpx.Client(base_url=stack.url, timeout=60) as client:

        def one(i: int) -> float:
            return float(_infer(client, "adaptive", 0.01, i).json()["outputs"][0]["data"][1])

        with ThreadPoolExecutor(16) as pool:
            markers = list(pool.map(one, range(64)))
    assert markers == list(range(64))
    stats = http.get("/v2/models/adaptive/stats").json()["model_stats"][0]
    assert any(b["batch_size"] > 1 for b in stats["batch_stats"])


def test_the_earlier_deadline_goes_first(stack: Stack) -> None:
    """The blocker computes (its 2 s hold the others' arrivals, however slow a busy machine
    makes them) while the relaxed request, then the urgent one, wait behind it."""
    assert stack.redis_url is not None
    stream = Keys(stack.namespace).request_stream("ordered", 1)
    redis = Redis.from_url(stack.redis_url)
    with (
        redis,
        ThreadPoolExecutor(3) as pool,
        httpx.Client(base_url=stack.url, timeout=60) as client,
    ):

        def queued(count: int) -> bool:
            return int(redis.xlen(stream)) >= count

        blocker = pool.submit(_infer, client, "ordered", 2.0, 0)
        assert wait_until(lambda: queued(1), 30), "the blocker never queued"
        relaxed = pool.submit(_infer, client, "ordered", 0.0, 1)  # the default timeout
        assert wait_until(lambda: queued(2), 30), "the relaxed request never queued"
        urgent = pool.submit(_infer, client, "ordered", 0.0, 2, timeout=10_000_000)
        first, later, earlier = (
            _order(blocker.result()),
            _order(relaxed.result()),
            _order(urgent.result()),
        )
    assert first < earlier < later


def test_a_request_that_cannot_make_its_deadline_is_answered_without_computing(
    http: httpx.Client,
) -> None:
    # The worker learns that a batch takes about 400 ms; a request with 200 ms left cannot
    # make it, and its answer has all of them to come back (a loaded machine once took
    # more than the 20 ms an earlier version left it).
    for i in range(10):
        assert _infer(http, "hopeless", 0.4, i).status_code == 200
    before = http.get("/v2/models/hopeless/stats").json()["model_stats"][0]
    response = _infer(http, "hopeless", 0.4, 99, timeout=200_000)
    assert response.status_code == 504
    assert "deadline would pass before its batch computes" in response.json()["error"]
    after = http.get("/v2/models/hopeless/stats").json()["model_stats"][0]
    assert after["execution_count"] == before["execution_count"]
    samples = scrape(http)
    assert samples[("sluice_batch_cost_model_error_ratio_count", "hopeless", "1", "")] >= 1
    # A deadline the batch can make is kept.
    assert _infer(http, "hopeless", 0.4, 100, timeout=4_000_000).status_code == 200
