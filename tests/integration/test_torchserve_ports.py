"""TorchServe's ports beside Sluice's: ``sluice up --torchserve-ports I,M,X`` (or
``--ts-config`` with TorchServe's addresses) serves its inference API on I, its management
API on M and its metrics on X, each port only its own API (TorchServe's 404 for the rest),
with TorchServe's frontend counters (``Requests2XX`` ...) on the metrics port."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from sluice.scheduler.executor.redis_server import RedisServer, free_port
from tests.support.onnx_models import write_identity
from tests.support.stack import Stack

NOT_FOUND = "Requested resource is not found, please refer to API document."


@pytest.fixture(scope="module")
def ports() -> tuple[int, int, int]:
    return free_port(), free_port(), free_port()


@pytest.fixture(scope="module")
def stack(
    tmp_path_factory: pytest.TempPathFactory,
    redis_server: RedisServer,
    ports: tuple[int, int, int],
) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("ts-ports")
    write_identity(root, "ident", ["FP32"])
    stack = Stack(root, redis_server.url, args=["--torchserve-ports", ",".join(map(str, ports))])
    stack.start()
    yield stack
    stack.stop()


def _url(port: int, path: str) -> str:
    return f"http://127.0.0.1:{port}{path}"


def _healthy(port: int) -> bool:
    """``/ping`` says Healthy, whichever gateway process answers: one that has not yet seen
    the models ready looks again before it answers."""
    answers = [httpx.get(_url(port, "/ping"), timeout=30) for _ in range(10)]  # (connections)
    return all(answer.json() == {"status": "Healthy"} for answer in answers)


def test_each_port_answers_its_own_api_only(stack: Stack, ports: tuple[int, int, int]) -> None:
    inference, management, metrics = ports
    with httpx.Client(timeout=30) as http:
        assert _healthy(inference)
        body = {
            "inputs": [{"name": "IN_FP32", "shape": [1, 3], "datatype": "FP32", "data": [1, 2, 3]}]
        }
        answer = http.post(_url(inference, "/v2/models/ident/infer"), json=body)
        assert answer.status_code == 200, answer.text
        listed = http.get(_url(management, "/models"))
        assert listed.status_code == 200, listed.text
        assert "ident" in {m["modelName"] for m in listed.json()["models"]}
        assert http.get(_url(management, "/workflows")).json() == {"workflows": []}
        unknown = http.post(_url(inference, "/wfpredict/none"), content=b"x")
        assert unknown.json()["message"] == "Workflow not found: none"
        for port, path in (
            (inference, "/models"),
            (inference, "/workflows"),
            (management, "/ping"),
            (management, "/v2"),
        ):
            refused = http.get(_url(port, path))
            assert refused.status_code == 404, (port, path)
            assert refused.json() == {
                "code": 404,
                "type": "ResourceNotFoundException",
                "message": NOT_FOUND,
            }
        assert http.get(_url(metrics, "/models")).status_code == 404
        # Sluice's own port still serves everything.
        assert http.get(f"{stack.url}/models").status_code == 200
        assert http.get(f"{stack.url}/ping").status_code == 200


def test_ts_config_places_the_ports_and_the_metrics_port_counts_answers_by_class(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """A fresh stack (nothing counted yet), its ports from TorchServe's addresses."""
    write_identity(tmp_path / "repo", "ident", ["FP32"])
    inference, management, metrics = free_port(), free_port(), free_port()
    config = tmp_path / "config.properties"
    config.write_text(
        f"inference_address=http://127.0.0.1:{inference}\n"
        f"management_address=http://127.0.0.1:{management}\n"
        f"metrics_address=http://127.0.0.1:{metrics}\n"
        "number_of_netty_threads=4\n"
    )
    stack = Stack(tmp_path / "repo", redis_server.url, args=["--ts-config", str(config)])
    stack.start()
    try:
        _count_answers_by_class(inference, management, metrics)
    finally:
        stack.stop()


def _count_answers_by_class(inference: int, management: int, metrics: int) -> None:
    def requests() -> tuple[float, float, float]:
        text = httpx.get(_url(metrics, "/metrics"), timeout=30).text
        found: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                name = sample.name.removesuffix("_total")
                if name.startswith("Requests"):
                    assert sorted(sample.labels) == ["Hostname", "Level"]
                    assert sample.labels["Level"] == "Host"
                    found[name] = sample.value
        return found["Requests2XX"], found["Requests4XX"], found["Requests5XX"]

    def settled() -> tuple[float, float, float]:
        # Each gateway process hands its counts over at its next report (within seconds).
        last = requests()
        while True:
            time.sleep(2.5)
            now = requests()
            if now == last:
                return now
            last = now

    with httpx.Client(timeout=30) as http:
        assert _healthy(inference)
        before = settled()
        for _ in range(3):
            assert http.get(_url(inference, "/ping")).status_code == 200
        assert http.get(_url(management, "/models")).status_code == 200
        assert http.get(_url(inference, "/nowhere")).status_code == 404
        assert http.post(_url(inference, "/predictions/missing"), content=b"x").status_code == 404
    moved = [after - earlier for after, earlier in zip(settled(), before, strict=True)]
    assert moved == [4, 2, 0]
    text = httpx.get(_url(metrics, "/metrics"), timeout=30).text
    assert "# HELP Requests2XX Torchserve prometheus counter metric with unit: Count" in text
    assert 'ts_inference_requests_total{model_name="ident",model_version="1",hostname=' in text
    only = httpx.get(_url(metrics, "/metrics"), params={"name[]": "Requests4XX"}).text
    assert [f.name for f in text_string_to_metric_families(only)] == ["Requests4XX"]
    # TorchServe's host gauges, with its units and labels.
    assert "# HELP MemoryUsed Torchserve prometheus gauge metric with unit: Megabytes" in text
    assert "# HELP DiskAvailable Torchserve prometheus gauge metric with unit: Gigabytes" in text
    gauges = {
        family.name: family.samples[0]
        for family in text_string_to_metric_families(text)
        if family.type == "gauge"
    }
    for name in ("CPUUtilization", "MemoryUtilization", "DiskUtilization"):
        assert 0 <= gauges[name].value <= 100, (name, gauges[name])
    for name in ("MemoryUsed", "MemoryAvailable", "DiskUsage", "DiskAvailable"):
        assert gauges[name].value > 0, (name, gauges[name])
        assert gauges[name].labels["Level"] == "Host" and gauges[name].labels["Hostname"]
    memory = httpx.get(_url(metrics, "/metrics"), params={"name[]": "MemoryUsed"}).text
    assert [f.name for f in text_string_to_metric_families(memory)] == ["MemoryUsed"]
