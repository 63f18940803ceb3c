"""``GET /metrics``: Triton's families, names, HELP texts and labels, moving with traffic.

The counters come from the statistics hashes in Redis, so they are checked against what
the requests did: successes, inferences, executions, failures by Triton's reasons
(BACKEND from a model that raises, REJECTED from a full queue and from a deadline that
passed in the queue), and the pending-request gauge while requests wait.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from redis import Redis

from sluice.core.keys import Keys
from sluice.core.observability.custom_metrics import encode_report
from sluice.core.settings import auto_gateway_processes
from sluice.scheduler.executor.redis_server import RedisServer
from tests.support.gate_model import BLOCKER_ITERS, open_gate, write_gate
from tests.support.gateway_refresh import wait_for_refresh
from tests.support.load import slow_request
from tests.support.model_files import python_config, tensor, write_fragile, write_model
from tests.support.onnx_models import write_identity
from tests.support.stack import Stack

TRITON_HELP = {
    "nv_inference_request_success": "Number of successful inference requests, all batch sizes",
    "nv_inference_request_failure": "Number of failed inference requests, all batch sizes",
    "nv_inference_count": "Number of inferences performed (does not include cached requests)",
    "nv_inference_exec_count": (
        "Number of model executions performed (does not include cached requests)"
    ),
    "nv_inference_request_duration_us": (
        "Cumulative inference request duration in microseconds (includes cached requests)"
    ),
    "nv_inference_queue_duration_us": (
        "Cumulative inference queuing duration in microseconds (includes cached requests)"
    ),
    "nv_inference_compute_input_duration_us": (
        "Cumulative compute input duration in microseconds (does not include cached requests)"
    ),
    "nv_inference_compute_infer_duration_us": (
        "Cumulative compute inference duration in microseconds (does not include cached requests)"
    ),
    "nv_inference_compute_output_duration_us": (
        "Cumulative inference compute output duration in microseconds (does not include "
        "cached requests)"
    ),
    "nv_inference_pending_request_count": (
        "Instantaneous number of pending requests awaiting execution per-model."
    ),
}
MODELS = {"ident", "fragile", "queued", "slow", "counted"}
REFRESH_S = 0.5
"""How often each gateway process reads the queues' depths (its catalog refresh)."""
Samples = dict[tuple[str, str, str, str], float]
COUNTED_MODEL = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        kinds = pb_utils.MetricFamily
        labels = {"stage": "answer"}
        # (the families are kept: deleting one deletes its metrics, as in Triton)
        self.families = [
            kinds("model_requests", "Requests seen", kinds.COUNTER),
            kinds("model_last_size", "Elements last seen", kinds.GAUGE),
            kinds("model_values", "Values seen", kinds.HISTOGRAM),
        ]
        self.requests = self.families[0].Metric(labels)
        self.size = self.families[1].Metric(labels)
        self.values = self.families[2].Metric(labels, buckets=[1.0, 10.0])

    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            self.requests.increment(1)
            self.size.set(x.size)
            for value in x.flatten():
                self.values.observe(float(value))
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", x)]))
        return responses
"""
"""A Triton Python model with custom metrics (Triton's ``pb_utils.MetricFamily``)."""


@pytest.fixture(scope="module")
def metered(tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("metrics")
    gate = tmp_path_factory.mktemp("gate")
    write_identity(root, "ident", ["FP32"])
    write_fragile(root)
    # Gate models: a request holds its worker until the test has seen what it needed
    # (tests/support/gate_model.py), not for a time guessed to be long enough.
    queued = write_gate(root, "queued", max_batch_size=8) / "config.pbtxt"
    with queued.open("a") as config:
        config.write("dynamic_batching { default_queue_policy { max_queue_size: 1 } }\n")
    write_gate(root, "slow")
    write_model(
        root,
        "counted",
        python_config([tensor("X", "TYPE_FP32", "-1")], [tensor("Y", "TYPE_FP32", "-1")]),
        {"1/model.py": COUNTED_MODEL},
    )
    # An idle gateway process refreshes its view of the queues every 2 s by default.
    stack = Stack(
        root,
        redis_server.url,
        env={"SLUICE_CATALOG_IDLE_REFRESH_S": str(REFRESH_S), "SLUICE_TEST_GATE": str(gate)},
    )
    stack.start()
    yield stack
    stack.stop()


@pytest.fixture(scope="module")
def http(metered: Stack) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=metered.url, timeout=60) as client:
        yield client


def scrape(http: httpx.Client) -> Samples:
    response = http.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    samples: Samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            labels = sample.labels
            # The parser reads a counter's samples as OpenMetrics' "<name>_total".
            name = sample.name.removesuffix("_total")
            key = (name, labels.get("model", ""), labels.get("version", ""))
            samples[(*key, labels.get("reason", ""))] = sample.value
    return samples


AllSamples = list[tuple[str, dict[str, str], float]]


def everything(http: httpx.Client) -> AllSamples:
    """Every sample with all its labels (names as written, ``_total`` kept)."""
    response = http.get("/metrics")
    assert response.status_code == 200
    return parsed(response.text)


def parsed(text: str) -> AllSamples:
    return [
        (s.name, s.labels, s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
    ]


def sample(samples: AllSamples, name: str, model: str, **labels: str) -> float:
    wanted = {"model": model, "version": "1", **labels}
    found = [v for n, lbl, v in samples if n == name and lbl == wanted]
    assert len(found) == 1, f"{name} {wanted}: {found}"
    return found[0]


def value(samples: Samples, name: str, model: str, reason: str = "") -> float:
    return samples[(name, model, "1", reason)]


def wait_for(check: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.1)
    return check()


def test_families_are_tritons_names_types_help_and_labels(http: httpx.Client) -> None:
    text = http.get("/metrics").text
    families = {family.name: family for family in text_string_to_metric_families(text)}
    for name, help_text in TRITON_HELP.items():
        assert f"# HELP {name} {help_text}\n" in text
        kind = "gauge" if name == "nv_inference_pending_request_count" else "counter"
        assert f"# TYPE {name} {kind}\n" in text
        samples = families[name].samples
        assert {s.labels["model"] for s in samples} == MODELS
        assert all(s.labels["version"] == "1" for s in samples)
        assert f"\n{name}{{model=" in text and f"{name}_total" not in text  # Triton's names
    reasons = {s.labels["reason"] for s in families["nv_inference_request_failure"].samples}
    assert reasons == {"REJECTED", "CANCELED", "BACKEND", "OTHER"}
    assert 0.0 <= families["nv_cpu_utilization"].samples[0].value <= 1.0
    total = families["nv_cpu_memory_total_bytes"].samples[0].value
    assert 0 < families["nv_cpu_memory_used_bytes"].samples[0].value <= total


def test_counters_move_with_traffic(http: httpx.Client) -> None:
    before = scrape(http)
    for _ in range(5):
        single = {
            "inputs": [{"name": "IN_FP32", "shape": [1, 3], "datatype": "FP32", "data": [1, 2, 3]}]
        }
        assert http.post("/v2/models/ident/infer", json=single).status_code == 200
    triple = {
        "inputs": [{"name": "IN_FP32", "shape": [3, 1], "datatype": "FP32", "data": [1, 2, 3]}]
    }
    assert http.post("/v2/models/ident/infer", json=triple).status_code == 200
    after = scrape(http)

    def delta(name: str) -> float:
        return value(after, name, "ident") - value(before, name, "ident")

    assert delta("nv_inference_request_success") == 6
    assert delta("nv_inference_count") == 8  # a batch-3 request counts 3
    assert 1 <= delta("nv_inference_exec_count") <= 6
    for name in TRITON_HELP:
        if name.endswith("_duration_us"):
            assert delta(name) >= 0, name
    assert delta("nv_inference_request_duration_us") > 0
    stats = http.get("/v2/models/ident/stats").json()["model_stats"][0]
    assert value(after, "nv_inference_count", "ident") == stats["inference_count"]
    assert value(after, "nv_inference_exec_count", "ident") == stats["execution_count"]


def test_backend_failures_are_counted_as_backend(http: httpx.Client) -> None:
    before = value(scrape(http), "nv_inference_request_failure", "fragile", "BACKEND")
    bad = {"inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [-1, 1]}]}
    assert http.post("/v2/models/fragile/infer", json=bad).status_code == 500
    after = scrape(http)
    assert value(after, "nv_inference_request_failure", "fragile", "BACKEND") == before + 1
    assert value(after, "nv_inference_request_failure", "fragile", "OTHER") == 0


def test_rejections_and_pending_requests(
    metered: Stack, http: httpx.Client, redis_server: RedisServer
) -> None:
    """A held request holds the worker: meanwhile a full queue refuses (REJECTED), a
    request queued behind it shows as pending, and one whose deadline passes while it
    waits is dropped by the worker (REJECTED too)."""
    before = scrape(http)
    before_everything = everything(http)
    answers: dict[str, int] = {}

    def send(name: str, model: str, body: dict[str, object]) -> None:
        with httpx.Client(base_url=metered.url, timeout=60) as client:
            answers[name] = client.post(f"/v2/models/{model}/infer", json=body).status_code

    def slow_now(name: str, **labels: str) -> float:
        return sample(everything(http), name, "slow", **labels)

    busy = [
        threading.Thread(target=send, args=("queued", "queued", slow_request(1, BLOCKER_ITERS))),
        threading.Thread(target=send, args=("slow", "slow", slow_request(2, BLOCKER_ITERS))),
    ]
    for thread in busy:
        thread.start()

    def computing(model: str) -> bool:
        return sample(everything(http), "sluice_pending_entries", model) >= 1

    assert wait_for(lambda: computing("queued") and computing("slow"), 30)
    # Every gateway process has seen the queue's depth (read at its refresh): the next
    # request to the full queue is refused.
    with Redis.from_url(redis_server.url) as client:
        assert wait_for_refresh(client, Keys(metered.namespace)), "no refresh"
    waiting = threading.Thread(target=send, args=("waiting", "slow", slow_request(3)))
    waiting.start()
    # The worker gathers the next batch while one computes: it takes this request and
    # holds it until the gate opens (in the stream, delivered, not answered).
    assert wait_for(lambda: slow_now("sluice_stream_length", priority="0") >= 2, 30)
    refused = http.post("/v2/models/queued/infer", json=slow_request(4))
    # Waits in the stream, behind the one the worker holds, past its deadline; it stays
    # there, undelivered, until the gate opens. What the gauges show is read meanwhile,
    # not by scrapes that had to land in a window.
    expired = http.post("/v2/models/slow/infer", json=slow_request(5, timeout_us=200_000))
    assert wait_for(lambda: slow_now("nv_inference_pending_request_count") >= 1, 30)
    held = everything(http)
    gate = Path(metered.env["SLUICE_TEST_GATE"])
    open_gate(gate, "queued")
    open_gate(gate, "slow")
    for thread in [*busy, waiting]:
        thread.join(60)
    assert refused.status_code == 503
    assert expired.status_code == 504
    assert answers == {"queued": 200, "slow": 200, "waiting": 200}
    # Requests aged while the held one waited; the expired one was still in the stream.
    assert sample(held, "sluice_oldest_request_age_seconds", "slow") > 0.1
    assert sample(held, "sluice_stream_length", "slow", priority="0") >= 3

    def rejected(model: str) -> float:
        return value(scrape(http), "nv_inference_request_failure", model, "REJECTED") - value(
            before, "nv_inference_request_failure", model, "REJECTED"
        )

    # The gateway hands its refusals over every catalog refresh (0.5 s).
    assert wait_for(lambda: rejected("queued") == 1), rejected("queued")
    assert wait_for(lambda: rejected("slow") == 1), rejected("slow")
    assert wait_for(lambda: value(scrape(http), "nv_inference_pending_request_count", "slow") == 0)

    def moved(name: str, model: str, **labels: str) -> float:
        return sample(everything(http), name, model, **labels) - sample(
            before_all, name, model, **labels
        )

    # Sluice's own view of the same events: why the gateway refused, where deadlines passed.
    before_all = before_everything
    assert wait_for(
        lambda: moved("sluice_admission_rejects_total", "queued", reason="queue_full") == 1
    )
    assert moved("sluice_admission_rejects_total", "queued", reason="in_flight") == 0
    assert wait_for(lambda: moved("sluice_deadline_misses_total", "slow", stage="queue") == 1)
    assert wait_for(lambda: moved("sluice_deadline_misses_total", "slow", stage="gateway") == 1)
    assert sample(everything(http), "sluice_oldest_request_age_seconds", "slow") == 0


SLUICE_PER_MODEL = {
    "sluice_stream_length": {"priority"},
    "sluice_consumer_lag": set(),
    "sluice_pending_entries": set(),
    "sluice_oldest_request_age_seconds": set(),
    "sluice_drain_time_seconds": set(),
    "sluice_reclaimed_entries_total": set(),
    "sluice_dead_letter_entries_total": set(),
    "sluice_deadline_misses_total": {"stage"},
    "sluice_admission_rejects_total": {"reason"},
    "sluice_instances": {"state"},
    "sluice_request_duration_seconds_bucket": {"le"},
    "sluice_queue_duration_seconds_bucket": {"le"},
    "sluice_compute_duration_seconds_bucket": {"le"},
    "sluice_batch_size_bucket": {"le"},
    "sluice_batch_closes_total": {"reason"},
    "sluice_batch_wait_seconds_bucket": {"le"},
    "sluice_batch_cost_model_error_ratio_bucket": {"le"},
}
SLUICE_GLOBAL = {
    "sluice_gateway_in_flight",
    "sluice_gateway_processes",
    "sluice_redis_round_trip_seconds",
    "sluice_gateway_body_budget_rejects_total",
    "sluice_shared_memory_bytes",
}


def test_sluice_families_cover_every_model_version(http: httpx.Client) -> None:
    samples = everything(http)
    for name, extra in SLUICE_PER_MODEL.items():
        found = [labels for n, labels, _ in samples if n == name]
        assert {labels["model"] for labels in found} == MODELS, name
        assert all(set(labels) == {"model", "version", *extra} for labels in found), name
    names = {n for n, _, _ in samples}
    assert names >= SLUICE_GLOBAL
    gauges = {n: v for n, labels, v in samples if n in SLUICE_GLOBAL and not labels}
    # (the test stacks run one gateway process unless asked; the last to start may not have
    # reported in yet)
    assert 1 <= gauges["sluice_gateway_processes"] <= auto_gateway_processes()
    assert gauges["sluice_gateway_in_flight"] >= 0
    assert 0 < gauges["sluice_redis_round_trip_seconds"] < 1
    for model in MODELS:
        assert sample(samples, "sluice_instances", model, state="ready") == 1
        assert sample(samples, "sluice_instances", model, state="failed") == 0


def test_histograms_count_every_success(http: httpx.Client) -> None:
    before = everything(http)
    single = {"inputs": [{"name": "IN_FP32", "shape": [2, 3], "datatype": "FP32", "data": [1] * 6}]}
    for _ in range(7):
        assert http.post("/v2/models/ident/infer", json=single).status_code == 200
    after = everything(http)

    def delta(name: str, **labels: str) -> float:
        return sample(after, name, "ident", **labels) - sample(before, name, "ident", **labels)

    success = delta("nv_inference_request_success_total")
    assert success == 7
    for name in ("request", "queue", "compute"):
        family = f"sluice_{name}_duration_seconds"
        assert delta(f"{family}_count") == success
        assert delta(f"{family}_bucket", le="+Inf") == success
        buckets = [
            (float(labels["le"]), v)
            for n, labels, v in after
            if n == f"{family}_bucket" and labels["model"] == "ident"
        ]
        counts = [v for _, v in sorted(buckets)]
        assert counts == sorted(counts), f"{family} buckets are cumulative"
    assert delta("sluice_request_duration_seconds_sum") > 0
    # One execution per batch; its size in items (Triton's inference count).
    assert delta("sluice_batch_size_count") == delta("nv_inference_exec_count_total")
    assert delta("sluice_batch_size_sum") == delta("nv_inference_count_total") == 14


def test_metrics_need_a_key_when_keys_are_set(
    tmp_path: Path, start_stack: Callable[..., Stack]
) -> None:
    write_identity(tmp_path, "ident", ["FP32"])
    stack = start_stack(tmp_path, env={"SLUICE_API_KEYS": "k1"})
    with httpx.Client(base_url=stack.url, timeout=10) as client:
        assert client.get("/metrics").status_code == 401
        response = client.get("/metrics", headers={"Authorization": "Bearer k1"})
        assert response.status_code == 200
        assert "nv_inference_count" in response.text


def test_a_models_own_metrics_are_on_metrics(http: httpx.Client) -> None:
    """Triton's Python-backend custom metrics: a counter, a gauge and a histogram the model
    defines show on ``/metrics`` with its labels, once the worker's heartbeat reports them."""
    for values in ([0.5, 5.0, 50.0], [2.0]):
        body = {
            "inputs": [{"name": "X", "datatype": "FP32", "shape": [1, len(values)], "data": values}]
        }
        assert http.post("/v2/models/counted/infer", json=body).status_code == 200

    def reported() -> AllSamples | None:
        samples = everything(http)
        requests = [v for n, lbl, v in samples if n == "model_requests_total"]
        return samples if requests == [2.0] else None

    assert wait_for(lambda: reported() is not None, 15)
    samples = reported()
    assert samples is not None
    stage = {"stage": "answer"}
    assert ("model_last_size", stage, 1.0) in samples
    buckets = {lbl["le"]: v for n, lbl, v in samples if n == "model_values_bucket"}
    assert buckets == {"1": 1.0, "10": 3.0, "+Inf": 4.0}
    assert ("model_values_count", stage, 4.0) in samples
    assert ("model_values_sum", stage, 57.5) in samples
    text = http.get("/metrics").text
    assert "# TYPE model_requests counter" in text and 'model_requests{stage="answer"} 2' in text


def test_a_dead_workers_report_leaves_with_the_next_scrape(
    metered: Stack, http: httpx.Client, redis_server: RedisServer
) -> None:
    """A worker killed without leaving keeps its report in Redis until it expires: the next
    scrape removes it, and its numbers are not shown; so is a report left with no expiry."""
    keys = Keys(metered.namespace)
    client = Redis.from_url(redis_server.url)
    try:
        report = [
            {
                "name": "ghost",
                "description": "G",
                "kind": "counter",
                "series": [
                    {
                        "labels": {},
                        "value": 1,
                        "set_at": 0,
                        "buckets": [],
                        "counts": [],
                        "sum": 0,
                        "count": 0,
                    }
                ],
            }
        ]
        client.hset(keys.custom_metrics, "dead-worker", encode_report(report))
        client.zadd(keys.custom_metrics_expiry, {"dead-worker": time.time() - 1})
        # A report with no expiry at all: written back by its worker just as a scrape
        # removed both, the worker dying before its next beat would have set the expiry.
        client.hset(keys.custom_metrics, "orphan-worker", encode_report(report))
        assert "ghost" not in http.get("/metrics").text
        assert not client.hexists(keys.custom_metrics, "dead-worker")
        assert client.zscore(keys.custom_metrics_expiry, "dead-worker") is None
        assert not client.hexists(keys.custom_metrics, "orphan-worker")
    finally:
        client.close()
