"""h2load's fixed-rate plan spreads arrivals evenly, and its output parses."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from bench import h2load
from bench.http_request import RequestParts

FIXTURES = Path(__file__).parent / "fixtures"


def arrival_offsets(plan: h2load.ArrivalPlan) -> list[float]:
    """When (ms, modulo a client's interval) each client sends, clients started ``period``
    apart."""
    interval_ms = 1000.0 / plan.per_client_rate
    return sorted((i * plan.period_ms) % interval_ms for i in range(plan.clients))


@pytest.mark.parametrize("rate", [50.0, 100.0, 150.0, 200.0, 1000.0, 2000.0, 5000.0])
def test_arrivals_are_evenly_spaced(rate: float) -> None:
    plan = h2load.arrival_plan(rate)
    assert plan.even
    assert plan.clients * plan.per_client_rate == pytest.approx(rate)
    assert 1 / plan.per_client_rate >= h2load.CLIENT_INTERVAL_S - 1e-12
    offsets = arrival_offsets(plan)
    gaps = [b - a for a, b in itertools.pairwise(offsets)]
    assert all(gap == pytest.approx(1000.0 / rate) for gap in gaps)


def test_rate_1000_uses_one_ms_starts_and_twenty_clients() -> None:
    assert h2load.arrival_plan(1000.0) == h2load.ArrivalPlan(20, 1, 50.0, even=True)


def test_more_clients_on_request() -> None:
    assert h2load.arrival_plan(100.0, min_clients=8).clients == 8


def test_a_rate_no_period_fits_is_flagged() -> None:
    assert not h2load.arrival_plan(333.3).even


def test_command_posts_the_body_with_the_headers(tmp_path: Path) -> None:
    parts = RequestParts(
        "POST", "/v2/models/mlp/infer", {"Inference-Header-Content-Length": "58"}, b"x"
    )
    plan = h2load.arrival_plan(100.0)
    line = h2load.command(
        "h2load", "http://127.0.0.1:8000", parts, tmp_path / "b", plan, 500, tmp_path / "l"
    )
    assert "--h1" in line
    assert "--header=Inference-Header-Content-Length: 58" in line
    assert f"--data={tmp_path / 'b'}" in line
    assert "--requests=500" in line
    assert "--rate-period=10ms" in line
    assert line[-1] == "http://127.0.0.1:8000/v2/models/mlp/infer"


def test_parses_a_real_run_and_its_log() -> None:
    result = h2load.parse_output(
        (FIXTURES / "h2load_binary.txt").read_text(),
        (FIXTURES / "h2load_log_binary.tsv").read_text(),
    )
    assert result.total == result.succeeded == 200
    assert result.errors == 0
    assert result.elapsed_s == pytest.approx(2.0)
    assert result.requests_per_s == pytest.approx(100.23)
    assert result.status_counts == {"2xx": 200, "3xx": 0, "4xx": 0, "5xx": 0}
    assert result.request_time_ms == pytest.approx(
        {"min": 1.86, "max": 9.15, "mean": 2.83, "sd": 0.752}
    )
    assert len(result.latencies_s) == 200
    assert max(result.latencies_s) == pytest.approx(0.009148)
    assert 1.9 < result.log_span_s < 2.1


def test_parses_a_json_mode_run() -> None:
    result = h2load.parse_output((FIXTURES / "h2load_json.txt").read_text())
    assert result.succeeded == 300
    assert result.latencies_s == []  # no log given


def test_non_2xx_answers_are_failures_and_left_out_of_the_latencies() -> None:
    result = h2load.parse_output(
        (FIXTURES / "h2load_non2xx.txt").read_text(),
        (FIXTURES / "h2load_log_non2xx.tsv").read_text(),
    )
    assert result.succeeded == 0
    assert result.errors == result.failed == 40
    assert result.status_counts["4xx"] == 40
    assert result.latencies_s == []
    assert result.request_time_ms["min"] == pytest.approx(0.283)


def test_connection_refused_counts_every_request_as_an_error() -> None:
    result = h2load.parse_output((FIXTURES / "h2load_refused.txt").read_text())
    assert result.errored == result.errors == 5
    assert result.elapsed_s == pytest.approx(260e-6)


def test_output_without_a_summary_is_refused() -> None:
    with pytest.raises(ValueError, match="no summary"):
        h2load.parse_output("starting benchmark...\n")


def test_failed_rows_of_the_log_carry_no_latency() -> None:
    latencies, span = h2load.parse_log("1000000\t200\t500\n1000100\t-1\t0\n1001000\t200\t1500\n")
    assert latencies == [0.0005, 0.0015]
    assert span == pytest.approx(0.0025)
