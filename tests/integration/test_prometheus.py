"""A real Prometheus scraping a running stack, with the alert rules of deploy/prometheus/.

Every target expression of the Grafana dashboard (deploy/grafana/dashboards/sluice.json)
and every metric the alert rules name must give series from what Sluice exports: a name
Sluice does not export fails here. The GPU row is evaluated only where a GPU exists;
elsewhere its names are checked against ``sluice.gateway.metrics.gpu.GPU_FAMILIES`` instead.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from sluice.scheduler.executor.redis_server import RedisServer, free_port
from tests.support.model_files import write_fragile
from tests.support.onnx_models import write_identity
from tests.support.stack import Stack

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS_DIR = ROOT / "deploy" / "prometheus"
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "sluice.json"
KEY = "prometheus-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
METRIC_NAME = re.compile(r"\b(?:sluice_\w+|nv_\w+)")
RATE_INTERVAL = "15s"
GPU_ROW = "GPU"  # the dashboard row whose panels read nv_gpu_* and nv_energy_consumption
MODELS = ("ident", "fragile")
IDENT_REQUESTS = 300
FRAGILE_REQUESTS = 60  # one in six makes the model raise: BACKEND failures


@dataclass
class Prometheus:
    url: str
    client: httpx.Client

    def query(self, expr: str) -> list[dict[str, Any]]:
        response = self.client.get("/api/v1/query", params={"query": expr})
        body = response.json()
        assert response.status_code == 200 and body["status"] == "success", (expr, body)
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    def value(self, expr: str) -> float:
        result = self.query(expr)
        return float(result[0]["value"][1]) if result else 0.0


def wait_for(check: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.2)
    assert check(), f"timed out after {timeout_s} s waiting for {what}"


def has_gpu() -> bool:
    """Whether this machine has an NVIDIA GPU (the gateway exports nv_gpu_* only then)."""
    if shutil.which("nvidia-smi") is None:
        return False
    listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=False)
    return listing.returncode == 0 and "GPU" in listing.stdout


def substitute(expr: str, model: str) -> str:
    """The dashboard's template variables as Grafana fills them for one model version."""
    for variable, value in (
        ("$__rate_interval", RATE_INTERVAL),
        ("$__interval", RATE_INTERVAL),
        ("$model", re.escape(model)),
        ("$version", "1"),
    ):
        expr = expr.replace(variable, value)
    assert "$" not in expr, f"a template variable the test does not know: {expr}"
    return expr


def dashboard_targets() -> list[tuple[str, str, str]]:
    """(row title, panel title, expression) for every target of every panel."""
    dashboard = json.loads(DASHBOARD.read_text())
    targets: list[tuple[str, str, str]] = []
    row = ""
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            row = panel["title"]
            continue
        for target in panel["targets"]:
            targets.append((row, panel["title"], target["expr"]))
    return targets


def metric_names(expr: str) -> set[str]:
    return set(METRIC_NAME.findall(expr))


def family(name: str) -> str:
    """sluice_x_bucket/_sum/_count -> sluice_x (Triton's nv_inference_count stays whole)."""
    if name.startswith("sluice_"):
        return re.sub(r"_(bucket|sum|count)$", "", name)
    return name


@pytest.fixture(scope="module")
def prometheus_stack(
    tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer
) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("prometheus-models")
    write_identity(
        root,
        "ident",
        ["FP32"],
        extra="dynamic_batching { max_queue_delay_microseconds: 2000 }\n"
        "response_cache { enable: true }",  # (the response cache's panel)
    )
    write_fragile(root)
    # A model loaded on demand, so that the host reports its memory budget and use.
    write_identity(
        root,
        "lazy",
        ["FP32"],
        extra='parameters { key: "sluice.load" value { string_value: "on_demand" } }',
    )
    # One tenant's key, so the per-tenant panels (queue time of named tenants) have series.
    env = {"SLUICE_API_KEYS": f"team:{KEY}", "SLUICE_RESPONSE_CACHE_BYTES": str(1 << 20)}
    stack = Stack(root, redis_server.url, env=env)
    stack.start()
    yield stack
    stack.stop()


@pytest.fixture(scope="module")
def prometheus(
    tmp_path_factory: pytest.TempPathFactory, prometheus_stack: Stack
) -> Iterator[Prometheus]:
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.fail(
            "prometheus is missing: scripts/bootstrap.sh installs it (Debian package prometheus)"
        )
    tmp = tmp_path_factory.mktemp("prometheus")
    # deploy/prometheus/prometheus.yml, pointed at this stack and scraping every second.
    config = yaml.safe_load((PROMETHEUS_DIR / "prometheus.yml").read_text())
    config["global"].update(scrape_interval="1s", evaluation_interval="1s")
    config["rule_files"] = [str(PROMETHEUS_DIR / name) for name in config["rule_files"]]
    (job,) = config["scrape_configs"]
    job["scrape_interval"] = "1s"
    job["static_configs"] = [{"targets": [prometheus_stack.address]}]
    # The scrape sends a key, from a file, as the deploy config does.
    key_file = tmp / "metrics-key"
    key_file.write_text(f"{KEY}\n")
    job["authorization"]["credentials_file"] = str(key_file)
    config_file = tmp / "prometheus.yml"
    config_file.write_text(yaml.safe_dump(config))
    port = free_port()
    log = (tmp / "prometheus.log").open("w")
    process = subprocess.Popen(
        [
            binary,
            f"--config.file={config_file}",
            f"--storage.tsdb.path={tmp / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(base_url=url, timeout=10) as client:

            def ready() -> bool:
                assert process.poll() is None, (tmp / "prometheus.log").read_text()
                try:
                    return client.get("/-/ready").status_code == 200
                except httpx.TransportError:
                    return False

            wait_for(ready, 30, "prometheus to be ready")
            yield Prometheus(url, client)
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


@pytest.fixture(scope="module")
def scraped(prometheus_stack: Stack, prometheus: Prometheus) -> Prometheus:
    """Prometheus once it has scraped the stack after some traffic, failures included."""
    wait_for(lambda: prometheus.value('up{job="sluice"}') == 1, 15, "the first successful scrape")

    def ident(i: int) -> int:
        rows = 1 + i % 3
        body = {
            "inputs": [
                {"name": "IN_FP32", "shape": [rows, 2], "datatype": "FP32", "data": [i] * 2 * rows}
            ]
        }
        with httpx.Client(base_url=prometheus_stack.url, timeout=30, headers=AUTH) as client:
            return client.post("/v2/models/ident/infer", json=body).status_code

    def fragile(i: int) -> int:
        sign = -1 if i % 6 == 0 else 1
        body = {"inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [sign, 1]}]}
        with httpx.Client(base_url=prometheus_stack.url, timeout=30, headers=AUTH) as client:
            return client.post("/v2/models/fragile/infer", json=body).status_code

    with ThreadPoolExecutor(8) as pool:
        ident_codes = list(pool.map(ident, range(IDENT_REQUESTS)))
        fragile_codes = list(pool.map(fragile, range(FRAGILE_REQUESTS)))
    ident_codes += [ident(0) for _ in range(3)]  # answered from the response cache
    with httpx.Client(base_url=prometheus_stack.url, timeout=30, headers=AUTH) as client:
        bad = {"inputs": [{"name": "x", "shape": [1, 3], "datatype": "FP32", "data": [1, 2, 3]}]}
        assert client.post("/v2/models/fragile/infer", json=bad).status_code == 400
    assert ident_codes == [200] * (IDENT_REQUESTS + 3)
    # A batch with a negative input fails as a whole: at least one in six fail.
    assert set(fragile_codes) == {200, 500}, fragile_codes
    failures = fragile_codes.count(500)
    assert failures >= FRAGILE_REQUESTS // 6

    # Prometheus has the final counts, then a few more scrapes for the rates.
    wait_for(
        lambda: prometheus.value('nv_inference_request_success{model="ident"}') >= IDENT_REQUESTS,
        15,
        "prometheus to scrape the traffic",
    )
    wait_for(
        lambda: prometheus.value('sum(nv_inference_request_failure{model="fragile"})') >= failures,
        15,
        "prometheus to scrape the failures",
    )

    # A few more scrapes for the rates (a rate over the dashboard's interval needs two
    # samples in it): three of the final counts, however late a busy machine's come.
    def final_scrapes() -> int:
        selector = f'nv_inference_request_success{{model="ident"}}[{RATE_INTERVAL}]'
        return min(
            (
                sum(float(value) >= IDENT_REQUESTS for _, value in series["values"])
                for series in prometheus.query(selector)
            ),
            default=0,
        )

    wait_for(lambda: final_scrapes() >= 3, 60, "three scrapes of the final counts")
    return prometheus


def missing_names(prometheus: Prometheus, names: set[str]) -> set[str]:
    return {name for name in names if not prometheus.query(f'{{__name__="{name}"}}')}


def test_the_template_variables_find_the_models(scraped: Prometheus) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v["definition"] for v in dashboard["templating"]["list"]}
    match = re.fullmatch(r"label_values\((\w+), model\)", variables["model"])
    assert match, variables["model"]
    response = scraped.client.get("/api/v1/label/model/values", params={"match[]": match[1]})
    assert set(MODELS) <= set(response.json()["data"])
    for model in MODELS:
        match = re.fullmatch(r"label_values\((.+), version\)", variables["version"])
        assert match, variables["version"]
        selector = match[1].replace("$model", model)
        response = scraped.client.get("/api/v1/label/version/values", params={"match[]": selector})
        assert response.json()["data"] == ["1"], selector


def test_every_dashboard_target_gives_series(
    scraped: Prometheus, capsys: pytest.CaptureFixture[str]
) -> None:
    gpu = has_gpu()
    failures: list[str] = []
    missing: set[str] = set()
    gpu_names: set[str] = set()
    targets = dashboard_targets()
    assert any(row == GPU_ROW for row, _, _ in targets), f"no {GPU_ROW} row in the dashboard"
    for row, title, expr in targets:
        names = metric_names(expr)
        assert names, f"{title}: no metric named in {expr}"
        if row == GPU_ROW and not gpu:
            gpu_names |= names
            continue
        for model in MODELS:
            query = substitute(expr, model)
            if not scraped.query(query):
                failures.append(f"{row} / {title} ({model}): no series for {query}")
        missing |= missing_names(scraped, names)
    if gpu_names:
        with capsys.disabled():
            print(
                "\nNo GPU on this machine: the dashboard's GPU row was not evaluated "
                f"({', '.join(sorted(gpu_names))}); its names are checked against "
                "sluice.gateway.metrics.gpu.GPU_FAMILIES instead"
            )
        try:
            from sluice.gateway.metrics.gpu import GPU_FAMILIES
        except ImportError as error:
            failures.append(f"the GPU row's names cannot be checked: {error}")
        else:
            unknown = gpu_names - set(GPU_FAMILIES)
            if unknown:
                failures.append(f"GPU row names not in GPU_FAMILIES: {sorted(unknown)}")
    assert not failures, (
        f"metrics Sluice does not export: {sorted({family(n) for n in missing})}\n"
        + "\n".join(failures)
    )


def test_prometheus_loaded_every_alert_rule(scraped: Prometheus) -> None:
    rules_file = yaml.safe_load((PROMETHEUS_DIR / "alerts.yml").read_text())
    expected = {rule["alert"] for group in rules_file["groups"] for rule in group["rules"]}

    def loaded() -> list[dict[str, Any]]:
        body = scraped.client.get("/api/v1/rules", params={"type": "alert"}).json()
        assert body["status"] == "success", body
        groups: list[dict[str, Any]] = body["data"]["groups"]
        assert [group["name"] for group in groups] == ["sluice"]
        rules: list[dict[str, Any]] = groups[0]["rules"]
        return rules

    wait_for(lambda: all(rule["health"] != "unknown" for rule in loaded()), 10, "rule evaluation")
    rules = loaded()
    assert {rule["name"] for rule in rules} == expected
    assert {rule["name"]: (rule["health"], rule.get("lastError", "")) for rule in rules} == {
        name: ("ok", "") for name in expected
    }
    missing: dict[str, set[str]] = {}
    for rule in rules:
        # Healthy, an alert's expression is empty: each metric it names must give series.
        names = metric_names(rule["query"])
        assert names, rule
        if absent := missing_names(scraped, names):
            missing[rule["name"]] = {family(name) for name in absent}
    assert not missing, f"alert rules name metrics Sluice does not export: {missing}"
