"""How long a Triton Python model's custom metrics stay on ``GET /metrics``: as in Triton,
as long as the ``MetricFamily`` object that made them, and the worker that holds it.

A real stack (explicit model control, short heartbeats): the model deletes its family on
request, its worker is killed, its model is unloaded; each time a real gateway's
``/metrics`` is read until the series are gone.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from sluice.scheduler.executor.redis_server import RedisServer
from tests.support import procs
from tests.support.model_files import python_config, tensor, write_model
from tests.support.stack import Stack

MODEL = "metered"
FAMILY = "lifecycle_requests"
HEARTBEAT_S = 0.5
"""A dead worker's report expires three beats after its last one."""
METERED = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        kinds = pb_utils.MetricFamily
        self.family = kinds("lifecycle_requests", "Requests seen", kinds.COUNTER)
        self.requests = self.family.Metric(labels={"stage": "answer"})

    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            if x.flatten()[0] < 0:
                self.family = None  # deleted: its metrics go with it
            try:
                self.requests.increment(1)
            except pb_utils.TritonModelException as exc:
                error = pb_utils.TritonError(str(exc))
                responses.append(pb_utils.InferenceResponse(error=error))
                continue
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", x)]))
        return responses
"""


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("lifecycle")
    write_model(
        root,
        MODEL,
        python_config([tensor("X", "TYPE_FP32", "-1")], [tensor("Y", "TYPE_FP32", "-1")]),
        {"1/model.py": METERED},
    )
    running = Stack(
        root,
        redis_server.url,
        env={"SLUICE_HEARTBEAT_S": str(HEARTBEAT_S)},
        args=["--model-control-mode", "explicit"],
    )
    running.start()
    yield running
    running.stop()


@pytest.fixture
def http(stack: Stack) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=stack.url, timeout=120) as client:
        yield client


def infer(http: httpx.Client, value: float) -> httpx.Response:
    body = {"inputs": [{"name": "X", "datatype": "FP32", "shape": [1, 1], "data": [value]}]}
    return http.post(f"/v2/models/{MODEL}/infer", json=body)


def requests_seen(http: httpx.Client) -> float | None:
    """The model's counter on ``/metrics``; None when it is not there."""
    response = http.get("/metrics")
    assert response.status_code == 200
    for family in text_string_to_metric_families(response.text):
        if family.name == FAMILY:
            (sample,) = family.samples
            return sample.value
    return None


def wait_for(check: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.1)
    return check()


def fresh(http: httpx.Client) -> None:
    """The model loaded with new workers, whatever an earlier test left (a load of what is
    loaded, unchanged, keeps its workers)."""
    assert http.post(f"/v2/repository/models/{MODEL}/unload").status_code == 200
    assert http.post(f"/v2/repository/models/{MODEL}/load").status_code == 200


def test_a_family_the_model_deletes_leaves_metrics(http: httpx.Client) -> None:
    """Triton deletes a ``MetricFamily``'s metrics with it: its series leave ``/metrics``
    (at the worker's next beat), and the ``Metric`` object left refuses with Triton's
    error."""
    fresh(http)
    for _ in range(2):
        assert infer(http, 1.0).status_code == 200
    assert wait_for(lambda: requests_seen(http) == 2, 10)

    refused = infer(http, -1.0)
    assert refused.status_code != 200
    assert "'MetricFamily' has been deleted" in refused.json()["error"]
    assert wait_for(lambda: requests_seen(http) is None, 15)  # (a beat: every second)
    assert f"# TYPE {FAMILY}" not in http.get("/metrics").text


def test_a_killed_workers_series_expire_and_an_unloaded_models_leave_at_once(
    stack: Stack, http: httpx.Client
) -> None:
    """A worker killed (SIGKILL) cannot take its report back: its count leaves the sum once
    its report expires (the new worker's own starts at zero). An unload stops the workers,
    each taking its report back as it leaves: gone by the time the unload answers."""
    assert stack.process is not None
    fresh(http)
    assert infer(http, 1.0).status_code == 200
    assert wait_for(lambda: requests_seen(http) == 1, 10)

    (victim,) = procs.worker_pids(stack.process.pid, MODEL)
    os.kill(victim, signal.SIGKILL)
    # Its replacement reports 0 for the same series; the dead one's 1 stays in the sum
    # until its report expires (three beats), then leaves it.
    assert wait_for(lambda: requests_seen(http) == 0, 30)

    assert http.post(f"/v2/repository/models/{MODEL}/unload").status_code == 200
    assert requests_seen(http) is None
