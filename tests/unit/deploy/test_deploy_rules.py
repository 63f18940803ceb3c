"""deploy/: the Prometheus config and alert rules pass promtool (syntax and unit tests), and
the Grafana dashboard is sane: Prometheus data source everywhere, model/version variables,
expressions that parse, and a panel for every family operators need."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[3]
PROMETHEUS_DIR = ROOT / "deploy" / "prometheus"
GRAFANA_DIR = ROOT / "deploy" / "grafana"
DASHBOARD = GRAFANA_DIR / "dashboards" / "sluice.json"
METRIC_NAME = re.compile(r"\b(?:sluice_\w+|nv_\w+)")
GPU_PREFIXES = ("nv_gpu_", "nv_energy_")
ALERTS = {
    "SluiceHighErrorRate",
    "SluiceLatencyP99AboveObjective",
    "SluiceOldestRequestTooOld",
    "SluiceQueueGrowing",
    "SluiceNoReadyInstance",
    "SluiceDeadLetters",
}
# Every family the dashboard must show (histograms by their _bucket series).
DASHBOARD_FAMILIES = {
    "nv_inference_request_success",
    "nv_inference_request_failure",
    "nv_inference_count",
    "nv_inference_exec_count",
    "nv_inference_request_duration_us",
    "nv_inference_pending_request_count",
    "sluice_request_duration_seconds_bucket",
    "sluice_queue_duration_seconds_bucket",
    "sluice_compute_duration_seconds_bucket",
    "sluice_batch_size_bucket",
    "sluice_batch_closes_total",
    "sluice_batch_wait_seconds_bucket",
    "sluice_batch_cost_model_error_ratio_bucket",
    "sluice_stream_length",
    "sluice_consumer_lag",
    "sluice_pending_entries",
    "sluice_oldest_request_age_seconds",
    "sluice_drain_time_seconds",
    "sluice_instances",
    "sluice_admission_rejects_total",
    "sluice_deadline_misses_total",
    "sluice_reclaimed_entries_total",
    "sluice_dead_letter_entries_total",
    "sluice_gateway_in_flight",
    "sluice_redis_round_trip_seconds",
    "sluice_shared_memory_bytes",
    "nv_cpu_utilization",
    "nv_cpu_memory_used_bytes",
    "nv_gpu_utilization",
    "nv_gpu_memory_used_bytes",
    "nv_gpu_power_usage",
    "nv_energy_consumption",
    "sluice_tenant_requests_total",
    "sluice_tenant_rejected_total",
    "sluice_tenant_cancelled_total",
    "sluice_tenant_queue_duration_seconds_bucket",
    "sluice_model_cold_start_seconds_bucket",
    "sluice_model_evictions_total",
    "sluice_memory_budget_bytes",
    "sluice_memory_used_bytes",
}


def promtool(*args: str, cwd: Path = PROMETHEUS_DIR) -> str:
    binary = shutil.which("promtool")
    if binary is None:
        pytest.fail("promtool is missing: scripts/bootstrap.sh installs it (Debian prometheus)")
    done = subprocess.run(
        [binary, *args], cwd=cwd, capture_output=True, text=True, check=False, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return loaded


def panels() -> list[dict[str, Any]]:
    return [panel for panel in dashboard()["panels"] if panel["type"] != "row"]


def test_promtool_checks_the_config_and_the_rules(tmp_path: Path) -> None:
    assert "SUCCESS: 6 rules found" in promtool("check", "rules", "alerts.yml")
    # promtool wants the key file the scrape names, which only the container has: the same
    # config, pointing at a key file here.
    config = load_yaml(PROMETHEUS_DIR / "prometheus.yml")
    key = tmp_path / "metrics-key"
    key.write_text("k")
    config["scrape_configs"][0]["authorization"]["credentials_file"] = str(key)
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    shutil.copy(PROMETHEUS_DIR / "alerts.yml", tmp_path / "alerts.yml")
    assert "SUCCESS" in promtool("check", "config", "prometheus.yml", cwd=tmp_path)


def test_promtool_unit_tests_of_the_alerts_pass() -> None:
    assert "SUCCESS" in promtool("test", "rules", "alerts_test.yml")


def test_the_scrape_config_reads_the_gateways_metrics_port() -> None:
    config = load_yaml(PROMETHEUS_DIR / "prometheus.yml")
    assert config["rule_files"] == ["alerts.yml"]
    (job,) = config["scrape_configs"]
    assert job["metrics_path"] == "/metrics"
    assert job["scrape_interval"] == "5s"
    assert job["static_configs"] == [{"targets": ["gateway:8002"]}]
    # The gateway wants a key on every route but health (compose.yaml writes this file).
    assert job["authorization"] == {
        "type": "Bearer",
        "credentials_file": "/run/sluice/metrics-key",
    }


def test_every_alert_is_complete_and_tested_firing_and_quiet() -> None:
    (group,) = load_yaml(PROMETHEUS_DIR / "alerts.yml")["groups"]
    assert group["name"] == "sluice"
    rules = {rule["alert"]: rule for rule in group["rules"]}
    assert set(rules) == ALERTS
    for name, rule in rules.items():
        assert "for" in rule, name
        assert rule["labels"]["severity"] in {"warning", "critical"}, name
        assert "by (model, version" in rule["expr"], name
        for annotation in ("summary", "description"):
            text = rule["annotations"][annotation]
            assert "{{ $labels.model }}" in text and "{{ $labels.version }}" in text, name
    firing: set[str] = set()
    quiet: set[str] = set()
    for test in load_yaml(PROMETHEUS_DIR / "alerts_test.yml")["tests"]:
        for check in test["alert_rule_test"]:
            (firing if check["exp_alerts"] else quiet).add(check["alertname"])
    assert firing == ALERTS
    assert quiet == ALERTS


def test_every_panel_reads_the_prometheus_data_source() -> None:
    ids = [panel["id"] for panel in dashboard()["panels"]]
    assert len(ids) == len(set(ids))
    for panel in panels():
        assert panel["datasource"] == {"type": "prometheus", "uid": "prometheus"}, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "prometheus", panel["title"]
            assert target["expr"].strip(), panel["title"]
    datasources = load_yaml(GRAFANA_DIR / "provisioning" / "datasources" / "prometheus.yml")
    (source,) = datasources["datasources"]
    assert (source["uid"], source["type"], source["url"]) == (
        "prometheus",
        "prometheus",
        "http://prometheus:9090",
    )
    providers = load_yaml(GRAFANA_DIR / "provisioning" / "dashboards" / "sluice.yml")
    (provider,) = providers["providers"]
    assert provider["type"] == "file" and provider["options"]["path"]


def test_model_and_version_variables_come_from_label_values() -> None:
    variables = {v["name"]: v for v in dashboard()["templating"]["list"]}
    assert set(variables) == {"model", "version"}
    for name, variable in variables.items():
        assert variable["type"] == "query"
        assert variable["datasource"]["uid"] == "prometheus"
        assert re.fullmatch(rf"label_values\(.+, {name}\)", variable["definition"]), name
        assert variable["query"]["query"] == variable["definition"]
    assert "$model" in variables["version"]["definition"]
    for panel in panels():
        for target in panel["targets"]:
            expr = target["expr"]
            if "model" in expr and "by (model" in expr:  # per model version: both filters
                assert 'model=~"$model"' in expr and 'version=~"$version"' in expr, expr


def test_every_expression_parses(tmp_path: Path) -> None:
    """promtool parses the dashboard's expressions as recording rules, variables filled in."""
    rules = []
    for index, panel in enumerate(panels()):
        for target in panel["targets"]:
            expr = target["expr"]
            for variable, value in (
                ("$__rate_interval", "1m"),
                ("$__interval", "1m"),
                ("$model", "m"),
                ("$version", "1"),
            ):
                expr = expr.replace(variable, value)
            assert "$" not in expr, expr
            rules.append({"record": f"dashboard:panel{index}:{target['refId']}", "expr": expr})
    (tmp_path / "dashboard.yml").write_text(
        yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]})
    )
    assert f"SUCCESS: {len(rules)} rules found" in promtool(
        "check", "rules", "dashboard.yml", cwd=tmp_path
    )


def test_the_dashboard_shows_every_family() -> None:
    named = {name for panel in panels() for name in panel_names(panel)}
    assert not DASHBOARD_FAMILIES - named, DASHBOARD_FAMILIES - named
    gpu = [p for p in panels() if any(n.startswith(GPU_PREFIXES) for n in panel_names(p))]
    assert gpu, "no GPU panel"
    for panel in gpu:  # one line per GPU, as Triton labels them
        assert all("gpu_uuid" in target["expr"] for target in panel["targets"]), panel["title"]


def panel_names(panel: dict[str, Any]) -> set[str]:
    return {name for target in panel["targets"] for name in METRIC_NAME.findall(target["expr"])}
