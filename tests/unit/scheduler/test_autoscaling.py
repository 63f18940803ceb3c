"""The scaling rule: from zero at once, panic doubling, up by the drain time, down only
after a quiet window and by at most half, always within min and max."""

from __future__ import annotations

import pytest

from sluice.core.config import parse_config_text
from sluice.core.errors import InvalidConfig
from sluice.scheduler.controller.autoscaling import ScalePolicy, Scaler, Signals

POLICY = ScalePolicy(min_instances=0, max_instances=8, objective_s=1.0)
IDLE = Signals(backlog=0, busy=0, oldest_age_s=0.0, answered_per_s=0.0)


def test_the_first_request_starts_an_instance() -> None:
    assert Scaler(POLICY).target(0, Signals(1, 0, 0.01, 0.0), now=0) == 1


def test_an_old_request_doubles_the_instances_at_once() -> None:
    assert Scaler(POLICY).target(2, Signals(50, 2, 0.6, 100.0), now=0) == 4
    assert Scaler(POLICY).target(6, Signals(50, 6, 0.9, 100.0), now=0) == 8  # the maximum


def test_a_backlog_that_drains_too_slowly_adds_what_drains_it() -> None:
    scaler = Scaler(POLICY)
    # One instance answers 100/s; 150 waiting take 1.5 s > half the objective: 3 instances.
    assert scaler.target(1, Signals(150, 1, 0.1, 100.0), now=0) == 3


def test_down_only_after_a_quiet_window_and_by_half_at_most() -> None:
    scaler = Scaler(POLICY)
    assert scaler.target(8, IDLE, now=0) == 8
    assert scaler.target(8, IDLE, now=29) == 8
    assert scaler.target(8, IDLE, now=31) == 4
    assert scaler.target(4, Signals(0, 3, 0.0, 50.0), now=70) == 4  # busy: the window restarts
    assert scaler.target(4, IDLE, now=71) == 4
    assert scaler.target(4, IDLE, now=102) == 2
    assert scaler.target(2, IDLE, now=133) == 1
    assert scaler.target(1, IDLE, now=164) == 0  # min 0: down to nothing


def test_min_and_max_hold() -> None:
    policy = ScalePolicy(min_instances=2, max_instances=3, objective_s=1.0, down_window_s=0)
    scaler = Scaler(policy)
    assert scaler.target(2, IDLE, now=0) == 2
    assert scaler.target(2, IDLE, now=10) == 2
    assert scaler.target(3, Signals(1000, 3, 5.0, 10.0), now=11) == 3


def test_the_policy_comes_from_the_config_parameters() -> None:
    text = 'backend: "onnxruntime"\nparameters { key: "%s" value { string_value: "%s" } }\n'
    config = parse_config_text(text % ("sluice.max_instances", "4"), model_name="m")
    assert ScalePolicy.from_config(config) == ScalePolicy(1, 4, 1.0, 30.0)
    plain = parse_config_text('backend: "onnxruntime"\n', model_name="m")
    assert ScalePolicy.from_config(plain) is None
    bad = parse_config_text(text % ("sluice.max_instances", "many"), model_name="m")
    with pytest.raises(InvalidConfig, match="autoscaling parameters"):
        ScalePolicy.from_config(bad)


@pytest.mark.parametrize("objective_ms", ["1e-310", "0.5", "inf", "nan", "1e12"])
def test_an_objective_the_rule_cannot_compute_with_is_refused(objective_ms: str) -> None:
    """Below a millisecond the drain-time rule's numbers overflow (the autoscaler's whole
    tick failed, for every model, each second); beyond a day there is nothing to scale."""
    text = 'backend: "onnxruntime"\n' + "".join(
        f'parameters {{ key: "{key}" value {{ string_value: "{value}" }} }}\n'
        for key, value in (
            ("sluice.max_instances", "4"),
            ("sluice.latency_objective_ms", objective_ms),
        )
    )
    config = parse_config_text(text, model_name="m")
    with pytest.raises(InvalidConfig, match=r"sluice\.latency_objective_ms must be within 1\.\."):
        ScalePolicy.from_config(config)


def test_the_smallest_objective_still_computes() -> None:
    scaler = Scaler(ScalePolicy(min_instances=1, max_instances=256, objective_s=0.001))
    assert scaler.target(1, Signals(10**9, 1, 0.0, 1e-3), now=0) == 256
