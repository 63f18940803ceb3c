"""Metrics stay right across processes: two gateways and two workers sum up, counters never
go back when a worker is killed, the metrics port serves the same text, and gateways run
apart from the workers (``sluice up --no-gateway`` + ``sluice gateway``) report the same."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from sluice.scheduler.executor.redis_server import RedisServer, free_port
from tests.support.onnx_models import write_identity
from tests.support.procs import wait_until, worker_pids
from tests.support.stack import Stack

REQUEST = {"inputs": [{"name": "IN_FP32", "shape": [1, 3], "datatype": "FP32", "data": [1, 2, 3]}]}


def scrape(url: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    response = httpx.get(f"{url}/metrics", timeout=10)  # a new connection each time
    assert response.status_code == 200, response.text
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(response.text)
        for s in family.samples
    }


def value(
    samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str
) -> float:
    return samples[(name, frozenset(labels.items()))]


def model_value(
    samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str
) -> float:
    return value(samples, name, model="ident", version="1", **labels)


def infer(url: str, count: int) -> None:
    for _ in range(count):  # one connection each: the kernel spreads them over the gateways
        assert (
            httpx.post(f"{url}/v2/models/ident/infer", json=REQUEST, timeout=30).status_code == 200
        )


@pytest.fixture
def two_by_two(tmp_path: Path, redis_server: RedisServer) -> Iterator[Stack]:
    write_identity(tmp_path, "ident", ["FP32"], extra="instance_group [ { count: 2 } ]")
    stack = Stack(
        tmp_path, redis_server.url, env={"SLUICE_GATEWAY_PROCESSES": "2"}, metrics_port=free_port()
    )
    stack.start()
    yield stack
    stack.stop()


def test_two_gateways_and_two_workers_sum_up(two_by_two: Stack) -> None:
    infer(two_by_two.url, 40)
    metrics_url = f"http://127.0.0.1:{two_by_two.metrics_port}"
    assert wait_until(lambda: value(scrape(two_by_two.url), "sluice_gateway_processes") == 2, 15)
    for url in [two_by_two.url, metrics_url] * 5:  # whichever process answers
        samples = scrape(url)
        assert model_value(samples, "nv_inference_request_success_total") == 40
        assert model_value(samples, "sluice_request_duration_seconds_count") == 40
        assert model_value(samples, "sluice_instances", state="ready") == 2
    stats = httpx.get(f"{two_by_two.url}/v2/models/ident/stats", timeout=10).json()
    per_instance = stats["model_stats"][0]["instance_stats"]
    assert len(per_instance) == 2, "both workers served"


def test_the_metrics_port_serves_metrics_only(two_by_two: Stack) -> None:
    metrics_url = f"http://127.0.0.1:{two_by_two.metrics_port}"
    # (the first scrapes after start may come before the gateway's first snapshot)
    assert wait_until(
        lambda: "nv_inference_request_success{" in httpx.get(f"{metrics_url}/metrics").text, 15
    )
    assert httpx.get(f"{metrics_url}/v2/health/ready").status_code == 404
    assert httpx.post(f"{metrics_url}/v2/models/ident/infer", json=REQUEST).status_code == 404
    assert httpx.post(f"{metrics_url}/metrics").status_code == 405
    assert any(
        line.startswith(f"Metrics at {metrics_url}/metrics") for line in two_by_two.stdout_lines
    )


def test_counters_never_go_back_when_a_worker_is_killed(two_by_two: Stack) -> None:
    assert two_by_two.process is not None
    infer(two_by_two.url, 10)
    before = scrape(two_by_two.url)
    victim = sorted(worker_pids(two_by_two.process.pid, "ident"))[0]
    os.kill(victim, signal.SIGKILL)
    assert wait_until(lambda: victim not in worker_pids(two_by_two.process.pid, "ident"), 15)  # type: ignore[union-attr]
    infer(two_by_two.url, 10)
    assert wait_until(
        lambda: model_value(scrape(two_by_two.url), "sluice_instances", state="ready") == 2, 15
    ), "the killed worker was restarted"
    after = scrape(two_by_two.url)
    for (name, labels), count in before.items():
        if name.endswith(("_total", "_count", "_sum", "_bucket")) or (
            name.startswith("nv_inference_") and "duration" in name
        ):
            assert after[(name, labels)] >= count, (name, labels)
    assert (
        model_value(after, "nv_inference_request_success_total")
        == model_value(before, "nv_inference_request_success_total") + 10
    )


def test_gateway_apart_from_the_workers(tmp_path: Path, redis_server: RedisServer) -> None:
    """The compose layout: ``sluice up --no-gateway`` runs the catalog and the workers,
    ``sluice gateway`` serves HTTP and metrics from the same Redis."""
    write_identity(tmp_path, "ident", ["FP32"])
    env = dict(
        os.environ, SLUICE_REDIS_URL=redis_server.url, SLUICE_NAMESPACE=f"t{uuid.uuid4().hex[:8]}"
    )
    port, metrics_port = free_port(), free_port()
    cli = [sys.executable, "-m", "sluice.cli"]
    workers = subprocess.Popen(
        [*cli, "up", "--no-gateway", "--model-repository", str(tmp_path)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    gateway = subprocess.Popen(
        [
            *cli,
            "gateway",
            "--http-port",
            str(port),
            "--metrics-port",
            str(metrics_port),
            "--grpc-port",
            "0",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        assert workers.stdout is not None
        assert workers.stdout.readline().startswith("Sluice workers started for 1 model instance")

        def ready() -> bool:
            try:
                return httpx.get(f"{url}/v2/health/ready", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        assert wait_until(ready, 60), "the gateway did not become ready"
        infer(url, 3)
        samples = scrape(f"http://127.0.0.1:{metrics_port}")
        assert model_value(samples, "nv_inference_request_success_total") == 3
        assert model_value(samples, "sluice_instances", state="ready") == 1
    finally:
        for process in (gateway, workers):
            process.send_signal(signal.SIGTERM)
        for process in (gateway, workers):
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if workers.stdout is not None:
            workers.stdout.close()
    assert workers.returncode == 0
