"""TorchServe's ports beside Sluice's: ``sluice up --torchserve-ports I,M,X`` (or
``--ts-config`` with TorchServe's addresses) serves its inference API on I, its management
API on M and its metrics on X, each port only its own API (TorchServe's 404 for the rest),
with TorchServe's frontend counters (``Requests2XX`` ...) on the metrics port."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.routing import APIRoute
from prometheus_client.parser import text_string_to_metric_families
from starlette.routing import BaseRoute

from sluice.core.settings import GatewaySettings
from sluice.gateway.app import create_app
from sluice.gateway.http.schema import INFER_PATHS
from sluice.gateway.torchserve.ports import TorchServePort, inference_path, management_path
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


def _route_table(served: Callable[[str], bool]) -> set[tuple[str, str]]:
    """(path, method) of every route of the gateway's route table that a port serving the
    paths ``served`` accepts lets through, the inference routes of its fast path too."""
    port = create_app(GatewaySettings()).torchserve_inference
    assert isinstance(port, TorchServePort)
    found = {
        (route.path, method.lower())
        for route in _api_routes(port.routes.routes)
        if served(route.path)
        for method in route.methods or ()
    }
    return found | {(path, "post") for path in INFER_PATHS if served(path)}


def _api_routes(routes: Sequence[BaseRoute]) -> Iterator[APIRoute]:
    """The routes of a route table, those of the routers it includes (unprefixed, as the
    gateway includes them) too."""
    for route in routes:
        if isinstance(route, APIRoute):
            yield route
        included = getattr(route, "original_router", None)  # (FastAPI's included routers)
        if included is not None:
            yield from _api_routes(included.routes)


def _operations(document: dict[str, Any]) -> set[tuple[str, str]]:
    return {(path, method) for path, item in document["paths"].items() for method in item}


DESCRIPTION = {("/", "options"), ("/api-description", "get")}


def test_each_port_describes_the_api_it_serves(stack: Stack, ports: tuple[int, int, int]) -> None:
    """TorchServe's ``OPTIONS /`` and ``/api-description``: an OpenAPI document of the
    port's API, every route the port serves in it (and nothing else)."""
    inference, management, metrics = ports
    with httpx.Client(timeout=30) as http:
        for port, served in ((inference, inference_path), (management, management_path)):
            described = http.options(_url(port, "/"))
            assert described.status_code == 200, described.text
            assert described.headers["content-type"] == "application/json"
            document = described.json()
            assert set(document) >= {"openapi", "info", "paths"}
            assert document["openapi"].startswith("3.")
            assert document["info"]["title"] == "TorchServe APIs"
            assert document["info"]["version"]
            assert _operations(document) == _route_table(served) | DESCRIPTION
            again = http.get(_url(port, "/api-description"))
            assert again.status_code == 200 and again.json() == document
            refused = http.get(_url(port, "/"))
            assert refused.status_code == 405
            assert refused.json() == {
                "code": 405,
                "type": "MethodNotAllowedException",
                "message": "Requested method is not allowed, please refer to API document.",
            }
        models = http.get(_url(management, "/api-description")).json()["paths"]["/models"]
        assert {p["name"] for p in models["get"]["parameters"]} == {"limit", "next_page_token"}
        assert "url" in {p["name"] for p in models["post"]["parameters"]}
        described = http.options(_url(metrics, "/"))
        assert described.status_code == 200
        assert described.headers["content-type"] == "application/json"
        document = described.json()
        assert _operations(document) == {("/metrics", "get")} | DESCRIPTION
        parameters = document["paths"]["/metrics"]["get"]["parameters"]
        assert [p["name"] for p in parameters] == ["name[]"]
        assert http.get(_url(metrics, "/api-description")).json() == document


def test_a_model_describes_its_api(stack: Stack, ports: tuple[int, int, int]) -> None:
    """``OPTIONS /predictions/{model}[/{version}]`` on the inference port and
    ``OPTIONS /models/{model}[/{version}]`` on the management port: TorchServe's
    description of one model's API (404 for a model or a version not served)."""
    inference, management, _ = ports
    with httpx.Client(timeout=30) as http:
        assert _healthy(inference)
        described = http.options(_url(inference, "/predictions/ident"))
        assert described.status_code == 200, described.text
        assert described.headers["content-type"] == "application/json"
        document = described.json()
        assert document["info"]["title"] == "RESTful API for: ident"
        assert {
            ("/predictions/ident", "post"),
            ("/explanations/ident", "post"),
            ("/v1/models/ident:explain", "post"),
            ("/v2/models/ident/infer", "post"),
        } <= _operations(document)
        assert all(
            path.startswith(
                (
                    "/predictions/ident",
                    "/explanations/ident",
                    "/v1/models/ident:",
                    "/v2/models/ident",
                )
            )
            for path in document["paths"]
        )
        assert http.options(_url(inference, "/predictions/ident/1.0")).json() == document
        missing = http.options(_url(inference, "/predictions/missing"))
        assert missing.status_code == 404
        assert missing.json()["message"] == "Model not found: missing"
        no_version = http.options(_url(inference, "/predictions/ident/9"))
        assert no_version.status_code == 404
        assert no_version.json()["message"] == "Model version: 9 does not exist for model: ident"
        managed = http.options(_url(management, "/models/ident"))
        assert managed.status_code == 200, managed.text
        document = managed.json()
        assert document["info"]["title"] == "RESTful Management API for: ident"
        assert {("/models/ident", m) for m in ("get", "put", "delete")} <= _operations(document)
        assert ("/models/ident/{version}/set-default", "put") in _operations(document)
        assert all(path.startswith("/models/ident") for path in document["paths"])
        # (Sluice's own port serves TorchServe's routes, their descriptions with them)
        assert http.options(f"{stack.url}/models/ident").json() == document


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
    assert 'ts_inference_requests_total{model_name="ident",model_version="1.0",hostname=' in text
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
