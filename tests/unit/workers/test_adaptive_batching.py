"""Adaptive batching's parts: the cost model, the arrival rate and the closing rule."""

from __future__ import annotations

import numpy as np
import pytest

from sluice.core.config import parse_config_text
from sluice.core.errors import InvalidConfig
from sluice.workers.adaptive import ArrivalRate, BatchPolicy, CostModel, batch_policy


def test_the_cost_model_finds_fixed_and_per_item_cost_through_noise() -> None:
    rng = np.random.default_rng(7)
    model = CostModel()
    for _ in range(400):
        items = int(rng.integers(1, 33))
        model.observe(items, 0.002 + 0.0001 * items + rng.normal(0, 0.0001))
    fixed, per_item = model.fit()
    assert fixed == pytest.approx(0.002, rel=0.1)
    assert per_item == pytest.approx(0.0001, rel=0.1)
    assert model.warm


def test_outliers_move_the_cost_model_a_bounded_amount() -> None:
    model = CostModel()
    for i in range(200):
        model.observe(1 + i % 16, 0.001 + 0.0001 * (1 + i % 16))
    before = model.predict(8)
    model.observe(8, 5.0)  # a pause of the whole process, once
    assert model.predict(8) == pytest.approx(before, rel=0.05)


def test_one_batch_size_counts_as_fixed_cost_and_nothing_is_negative() -> None:
    model = CostModel()
    assert model.fit() == (model.initial_s, 0.0)
    for _ in range(20):
        model.observe(1, 0.003)
    assert model.fit() == pytest.approx((0.003, 0.0))
    falling = CostModel()
    for items in (1, 2, 3, 4) * 10:
        falling.observe(items, 0.01 - 0.001 * items)  # never true, but never negative either
    fixed, per_item = falling.fit()
    assert fixed >= 0 and per_item >= 0


def test_bad_observations_are_ignored() -> None:
    model = CostModel()
    model.observe(0, 1.0)
    model.observe(4, float("nan"))
    model.observe(4, -1.0)
    assert model.observed == 0


def test_the_arrival_rate_follows_traffic_and_decays_without_it() -> None:
    rate = ArrivalRate(horizon_s=0.2)
    now = 0.0
    for _ in range(2000):
        now += 0.0005  # 2,000 items/s
        rate.add(1, now)
    assert rate.per_second(now) == pytest.approx(2000, rel=0.05)
    assert rate.per_second(now + 2.0) < 1
    bursts = ArrivalRate(horizon_s=0.2)
    for step in range(1, 201):
        bursts.add(10, step * 0.005)  # read in bursts of 10 every 5 ms: the same 2,000/s
    assert bursts.per_second(1.0) == pytest.approx(2000, rel=0.05)


def _policy(rate_per_s: float, fixed_s: float, per_item_s: float) -> BatchPolicy:
    policy = BatchPolicy(window_s=0.002, adaptive=True)
    for items in (1, 2, 4, 8) * 10:
        policy.cost.observe(items, fixed_s + per_item_s * items)
    now = 0.0
    for _ in range(int(rate_per_s)):
        now += 1 / rate_per_s
        policy.arrivals.add(1, now)
    return policy


def test_a_lone_request_goes_at_once_when_traffic_is_light() -> None:
    policy = _policy(rate_per_s=200, fixed_s=0.0005, per_item_s=0.00001)
    now = 1.0
    assert policy.target(now) < 1
    assert policy.close(1, 0.0, now) == "adaptive"


def test_heavy_traffic_waits_for_the_batch_that_pays() -> None:
    policy = _policy(rate_per_s=20000, fixed_s=0.001, per_item_s=0.00001)
    now = 1.0
    target = policy.target(now)  # 20000 * 0.001 / (1 + 0.2) ≈ 16.7
    assert target == pytest.approx(16.7, rel=0.1)
    assert policy.close(4, 0.0005, now) is None
    assert policy.close(17, 0.0005, now) == "adaptive"
    assert policy.close(4, 0.002, now) == "window"  # never past the window


def test_the_fixed_window_waits_it_out() -> None:
    policy = _policy(rate_per_s=200, fixed_s=0.0005, per_item_s=0.00001)
    policy.adaptive = False
    assert policy.close(1, 0.001, 1.0) is None
    assert policy.close(1, 0.002, 1.0) == "window"


def _config(parameters: str) -> str:
    return (
        'name: "m"\nplatform: "onnxruntime_onnx"\nmax_batch_size: 8\n'
        'input [ { name: "x" data_type: TYPE_FP32 dims: [ 2 ] } ]\n'
        'output [ { name: "y" data_type: TYPE_FP32 dims: [ 2 ] } ]\n'
        "dynamic_batching { max_queue_delay_microseconds: 2000 }\n" + parameters
    )


def test_the_config_turns_adaptive_batching_off_and_names_a_bad_value() -> None:
    on = batch_policy(parse_config_text(_config(""), model_name="m"))
    assert on.adaptive and on.window_s == pytest.approx(0.002)
    off = 'parameters { key: "adaptive_batching" value: { string_value: "false" } }'
    assert not batch_policy(parse_config_text(_config(off), model_name="m")).adaptive
    bad = 'parameters { key: "adaptive_batching" value: { string_value: "maybe" } }'
    with pytest.raises(InvalidConfig, match="parameter 'adaptive_batching' must be 0 or 1"):
        batch_policy(parse_config_text(_config(bad), model_name="m"))
