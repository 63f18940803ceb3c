"""The ensemble's graph runner without Redis: steps start as soon as their inputs exist
(independent branches together), outputs feed later steps, a failing step names itself
with the step's error class, and a batch is cut into requests and joined again."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from sluice.core.config import ModelConfig, parse_config_text
from sluice.core.errors import InvalidInput, SluiceError
from sluice.workers.backends.base import RequestContext
from sluice.workers.backends.ensemble_backend import (
    STEP_IN_FLIGHT,
    EnsembleBackend,
    step_in_flight,
)
from sluice.workers.backends.ensemble_join import join_requests, split_requests

_CONFIG = """
name: "diamond"
platform: "ensemble"
max_batch_size: 8
input [ { name: "IN" data_type: TYPE_FP32 dims: [ 2 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 2 ] } ]
ensemble_scheduling { step [
  { model_name: "add" model_version: -1 input_map { key: "A" value: "l" }
    input_map { key: "B" value: "r" } output_map { key: "S" value: "OUT" } },
  { model_name: "left" model_version: -1 input_map { key: "X" value: "IN" }
    output_map { key: "Y" value: "l" } },
  { model_name: "right" model_version: -1 input_map { key: "X" value: "IN" }
    output_map { key: "Y" value: "r" } }
] }
"""


_STEP_CONFIGS = {
    "add": 'backend: "python" max_batch_size: 8 input [ { name: "A" data_type: TYPE_FP32 '
    'dims: [ 2 ] }, { name: "B" data_type: TYPE_FP32 dims: [ 2 ] } ] '
    'output [ { name: "S" data_type: TYPE_FP32 dims: [ 2 ] } ]',
    "left": 'backend: "python" max_batch_size: 8 input [ { name: "X" data_type: TYPE_FP32 '
    'dims: [ 2 ] } ] output [ { name: "Y" data_type: TYPE_FP32 dims: [ 2 ] } ]',
}
_STEP_CONFIGS["right"] = _STEP_CONFIGS["left"]


class _Recorded(EnsembleBackend):
    """The runner with each step computed in-process, recording when steps start."""

    def __init__(self, config: ModelConfig, fail: str = "") -> None:  # no Redis, no loop
        self.setup(
            config,
            [
                parse_config_text(_STEP_CONFIGS[step.model_name], model_name=step.model_name)
                for step in config.ensemble_steps
            ],
        )
        self.fail = fail
        self.events: list[str] = []
        assert len(self._limits) == len(self.steps) and STEP_IN_FLIGHT > 1

    async def submit(
        self, index: int, reads: dict[str, np.ndarray], context: RequestContext
    ) -> dict[str, np.ndarray]:
        model = self.steps[index].model_name
        self.events.append(f"start {model}")
        await asyncio.sleep(0.01)
        self.events.append(f"end {model}")
        if model == self.fail:
            raise InvalidInput("bad shape")
        if model == "add":
            return {"S": reads["A"] + reads["B"]}
        return {"Y": reads["X"] * (2 if model == "left" else 3)}


def _config() -> ModelConfig:
    return parse_config_text(_CONFIG, model_name="diamond")


def test_branches_run_together_and_feed_the_join() -> None:
    runner = _Recorded(_config())
    x = np.array([[1.0, 2.0]], dtype=np.float32)
    answer = asyncio.run(runner.run({"IN": x}, ["OUT"], RequestContext("r", 0, None)))
    np.testing.assert_array_equal(answer["OUT"], 5 * x)
    assert set(runner.events[:2]) == {"start left", "start right"}
    assert runner.events[-2:] == ["start add", "end add"]


def test_a_failing_step_names_itself_and_keeps_its_class() -> None:
    runner = _Recorded(_config(), fail="right")
    x = np.ones((1, 2), dtype=np.float32)
    with pytest.raises(SluiceError) as caught:
        asyncio.run(runner.run({"IN": x}, ["OUT"], RequestContext("r", 0, None)))
    assert isinstance(caught.value, InvalidInput)
    assert caught.value.message == "in ensemble 'diamond', step 2 (model 'right'): bad shape"
    assert "start add" not in runner.events


def test_a_batch_is_cut_into_requests_and_joined_with_filler_for_failures() -> None:
    batch = {"IN": np.arange(10, dtype=np.float32).reshape(5, 2)}
    parts = split_requests(batch, [2, 3], batching=True)
    assert [p["IN"].shape for p in parts] == [(2, 2), (3, 2)]
    assert split_requests(batch, [1], batching=False)[0]["IN"] is batch["IN"]
    answers = [{"OUT": parts[0]["IN"]}, {}]
    joined = join_requests(answers, [2, 3], ["OUT"], {1: InvalidInput("no")})
    assert joined is not None and joined["OUT"].shape == (5, 2)
    np.testing.assert_array_equal(joined["OUT"][2:], 0)
    assert (
        join_requests([{}, {}], [2, 3], ["OUT"], {0: InvalidInput("a"), 1: InvalidInput("b")})
        is None
    )


def test_max_inflight_requests_bounds_each_steps_requests_in_flight() -> None:
    """Triton's ``ensemble_scheduling.max_inflight_requests``: at most that many requests
    of one instance are in flight to each step's model (0 or absent: 64)."""
    assert step_in_flight(_config()) == STEP_IN_FLIGHT
    bounded = _CONFIG.replace(
        "ensemble_scheduling {", "ensemble_scheduling { max_inflight_requests: 2"
    )
    runner = _Recorded(parse_config_text(bounded, model_name="diamond"))
    assert step_in_flight(runner.config) == 2

    async def eight_requests() -> None:
        x = np.ones((1, 2), dtype=np.float32)
        context = RequestContext("r", 0, None)
        await asyncio.gather(*(runner.run({"IN": x}, ["OUT"], context) for _ in range(8)))

    asyncio.run(eight_requests())
    in_flight, most = {"add": 0, "left": 0, "right": 0}, 0
    for event in runner.events:
        kind, model = event.split()
        in_flight[model] += 1 if kind == "start" else -1
        most = max(most, *in_flight.values())
    assert most == 2
