"""An ensemble as Triton's scheduler runs it, without Redis: only the steps that lead to the
requested outputs run; tensors gain a batch dimension of 1 on their way from a
non-batching ensemble (or model) into a batching model and lose it on the way back; an
output a composing model did not produce is left out of the answer, and a step that needs
it as a required input fails with Triton's text."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import numpy as np
import pytest

from sluice.core.config import ModelConfig, parse_config_text
from sluice.core.errors import InvalidInput
from sluice.workers.backends.base import PartialOutputs, RequestContext, absent_outputs
from sluice.workers.backends.ensemble_backend import EnsembleBackend
from sluice.workers.backends.ensemble_graph import dims_match, fit_shape, live_steps
from sluice.workers.backends.ensemble_join import join_requests

Step = Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]


def _tensor(name: str, dims: str = "3", optional: bool = False) -> str:
    extra = " optional: true" if optional else ""
    return f'{{ name: "{name}" data_type: TYPE_FP32 dims: [ {dims} ]{extra} }}'


def _model(name: str, inputs: list[str], outputs: list[str], max_batch_size: int) -> ModelConfig:
    return parse_config_text(
        f'backend: "python" max_batch_size: {max_batch_size} '
        f"input [ {', '.join(inputs)} ] output [ {', '.join(outputs)} ]",
        model_name=name,
    )


def _step(model: str, inputs: dict[str, str], outputs: dict[str, str]) -> str:
    maps = [f'input_map {{ key: "{k}" value: "{v}" }}' for k, v in inputs.items()]
    maps += [f'output_map {{ key: "{k}" value: "{v}" }}' for k, v in outputs.items()]
    return f'{{ model_name: "{model}" model_version: -1 {" ".join(maps)} }}'


def _ensemble(inputs: list[str], outputs: list[str], steps: list[str], batch: int) -> ModelConfig:
    return parse_config_text(
        f'platform: "ensemble" max_batch_size: {batch} '
        f"input [ {', '.join(inputs)} ] output [ {', '.join(outputs)} ] "
        f"ensemble_scheduling {{ step [ {', '.join(steps)} ] }}",
        model_name="ens",
    )


class _InProcess(EnsembleBackend):
    """The runner with each step computed in-process; records what each model was sent."""

    def __init__(
        self, config: ModelConfig, models: dict[str, ModelConfig], compute: dict[str, Step]
    ) -> None:  # no Redis, no loop
        self.setup(config, [models[step.model_name] for step in config.ensemble_steps])
        self.compute = compute
        self.sent: list[tuple[str, dict[str, tuple[int, ...]]]] = []

    async def submit(
        self, index: int, reads: dict[str, np.ndarray], context: RequestContext
    ) -> dict[str, np.ndarray]:
        model = self.steps[index].model_name
        self.sent.append((model, {name: array.shape for name, array in reads.items()}))
        return self.compute[model](reads)


def _run(
    runner: EnsembleBackend, inputs: dict[str, np.ndarray], outputs: list[str], batch: int = 0
) -> dict[str, np.ndarray]:
    context = RequestContext("req-1", 0, None)
    return asyncio.run(runner.run(inputs, outputs, context, batch))


# -- which steps run ------------------------------------------------------------------------

TWO_BRANCHES = _ensemble(
    [_tensor("IN")],
    [_tensor("OUT_A"), _tensor("OUT_B")],
    [
        _step("double", {"X": "IN"}, {"Y": "doubled"}),
        _step("plus_one", {"X": "doubled"}, {"Y": "OUT_A"}),
        _step("square", {"X": "IN"}, {"Y": "OUT_B"}),
    ],
    batch=8,
)


def test_only_the_steps_leading_to_the_requested_outputs_run() -> None:
    assert live_steps(TWO_BRANCHES, ["OUT_A", "OUT_B"]) == {0, 1, 2}
    assert live_steps(TWO_BRANCHES, ["OUT_A"]) == {0, 1}
    assert live_steps(TWO_BRANCHES, ["OUT_B"]) == {2}
    assert live_steps(TWO_BRANCHES, []) == set()


def test_a_step_whose_output_is_read_by_a_needed_step_runs() -> None:
    """A tensor that is an ensemble output not requested but read by a needed step keeps
    its writer (a backward walk from the unrequested outputs alone would drop it)."""
    config = _ensemble(
        [_tensor("IN")],
        [_tensor("MID"), _tensor("OUT")],
        [_step("a", {"X": "IN"}, {"Y": "MID"}), _step("b", {"X": "MID"}, {"Y": "OUT"})],
        batch=8,
    )
    assert live_steps(config, ["OUT"]) == {0, 1}
    assert live_steps(config, ["MID"]) == {0}


def test_a_step_writing_a_tensor_nothing_reads_still_runs_as_in_triton() -> None:
    config = _ensemble(
        [_tensor("IN")],
        [_tensor("OUT_A"), _tensor("OUT_B")],
        [
            _step("a", {"X": "IN"}, {"Y": "OUT_A"}),
            _step("b", {"X": "IN"}, {"Y": "OUT_B", "Z": "dangling"}),
        ],
        batch=8,
    )
    assert live_steps(config, ["OUT_A"]) == {0, 1}


def test_a_request_for_one_branch_sends_nothing_to_the_other() -> None:
    one_in_one_out = _model("m", [_tensor("X")], [_tensor("Y")], 8)
    runner = _InProcess(
        TWO_BRANCHES,
        {name: one_in_one_out for name in ("double", "plus_one", "square")},
        {
            "double": lambda r: {"Y": r["X"] * 2},
            "plus_one": lambda r: {"Y": r["X"] + 1},
            "square": lambda r: {"Y": r["X"] ** 2},
        },
    )
    x = np.array([[1.0, 2.0, 3.0]], dtype=np.float32)
    answer = _run(runner, {"IN": x}, ["OUT_A"], batch=1)
    assert list(answer) == ["OUT_A"]
    np.testing.assert_array_equal(answer["OUT_A"], 2 * x + 1)
    assert [model for model, _ in runner.sent] == ["double", "plus_one"]
    runner.sent.clear()
    assert set(_run(runner, {"IN": x}, ["OUT_B", "OUT_A"], batch=1)) == {"OUT_A", "OUT_B"}
    assert sorted(model for model, _ in runner.sent) == ["double", "plus_one", "square"]


class _Loop:
    """Stands in for the ensemble's ModelCalls: an event loop on a thread of its own."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)
        self.loop.close()


def test_requests_of_one_batch_each_run_the_steps_of_their_own_outputs() -> None:
    one_in_one_out = _model("m", [_tensor("X")], [_tensor("Y")], 8)
    runner = _InProcess(
        TWO_BRANCHES,
        {name: one_in_one_out for name in ("double", "plus_one", "square")},
        {
            "double": lambda r: {"Y": r["X"] * 2},
            "plus_one": lambda r: {"Y": r["X"] + 1},
            "square": lambda r: {"Y": r["X"] ** 2},
        },
    )
    runner._calls = _Loop()  # type: ignore[assignment]
    try:
        x = np.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], dtype=np.float32)
        contexts = [
            RequestContext("a", 0, None, outputs=("OUT_A",)),
            RequestContext("b", 0, None, outputs=("OUT_B",)),
        ]
        outputs = runner.infer({"IN": x}, ["OUT_A", "OUT_B"], [1, 1], contexts)
    finally:
        runner.close()
    assert sorted(model for model, _ in runner.sent) == ["double", "plus_one", "square"]
    assert absent_outputs(outputs) == {0: frozenset({"OUT_B"}), 1: frozenset({"OUT_A"})}
    np.testing.assert_array_equal(outputs["OUT_A"][:1], 2 * x[:1] + 1)
    np.testing.assert_array_equal(outputs["OUT_B"][1:], x[1:] ** 2)


# -- batch dimensions -----------------------------------------------------------------------


def test_fit_shape_follows_tritons_rules() -> None:
    assert dims_match((3, -1), (3, 7)) and not dims_match((3,), (1, 3))
    # made without a batch dimension, read by a batching model: gains 1 if it fits
    assert fit_shape((3,), True, 0, (3,)) == (1, 3)
    assert fit_shape((-1,), True, 0, (5,)) == (1, 5)
    assert fit_shape((3,), True, 0, (2, 3)) == (2, 3)  # taken as already batched
    # made with a batch dimension of 1, read by a non-batching model: loses it unless it fits
    assert fit_shape((3,), False, 1, (1, 3)) == (3,)
    assert fit_shape((1, 3), False, 1, (1, 3)) == (1, 3)
    assert fit_shape((3,), False, 2, (2, 3)) == (2, 3)  # more than 1: left as it is
    # both batch, or neither: unchanged
    assert fit_shape((3,), True, 4, (4, 3)) == (4, 3)
    assert fit_shape((3,), False, 0, (3,)) == (3,)


NON_BATCHING = _ensemble(
    [_tensor("IN")],
    [_tensor("OUT")],
    [_step("batching", {"X": "IN"}, {"Y": "mid"}), _step("flat", {"X": "mid"}, {"Y": "OUT"})],
    batch=0,
)


def test_a_non_batching_ensemble_feeds_a_batching_step_with_a_batch_of_one() -> None:
    """The batching model gets [1, 3] (Triton adds the batch dimension); the next,
    non-batching model gets [3] back; so does the client."""
    models = {
        "batching": _model("batching", [_tensor("X")], [_tensor("Y")], 8),
        "flat": _model("flat", [_tensor("X")], [_tensor("Y")], 0),
    }

    def batching(reads: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        assert reads["X"].ndim == 2, "a batching model gets a batch dimension"
        return {"Y": reads["X"] * 10}

    runner = _InProcess(
        NON_BATCHING, models, {"batching": batching, "flat": lambda r: {"Y": r["X"]}}
    )
    x = np.array([1.0, 2.0, 3.0], dtype=np.float32)
    answer = _run(runner, {"IN": x}, ["OUT"])
    assert runner.sent == [("batching", {"X": (1, 3)}), ("flat", {"X": (3,)})]
    assert answer["OUT"].shape == (3,)
    np.testing.assert_array_equal(answer["OUT"], x * 10)


def test_a_batching_step_answers_a_non_batching_ensemble_without_the_batch_dimension() -> None:
    config = _ensemble(
        [_tensor("IN")], [_tensor("OUT")], [_step("batching", {"X": "IN"}, {"Y": "OUT"})], 0
    )
    runner = _InProcess(
        config,
        {"batching": _model("batching", [_tensor("X")], [_tensor("Y")], 8)},
        {"batching": lambda r: {"Y": r["X"] + 1}},
    )
    answer = _run(runner, {"IN": np.zeros(3, np.float32)}, ["OUT"])
    assert runner.sent == [("batching", {"X": (1, 3)})]
    assert answer["OUT"].shape == (3,)


def test_a_batching_ensemble_feeds_a_non_batching_step_one_request_at_a_time() -> None:
    config = _ensemble(
        [_tensor("IN")], [_tensor("OUT")], [_step("flat", {"X": "IN"}, {"Y": "OUT"})], 8
    )
    runner = _InProcess(
        config,
        {"flat": _model("flat", [_tensor("X")], [_tensor("Y")], 0)},
        {"flat": lambda r: {"Y": r["X"] * 2}},
    )
    x = np.ones((1, 3), np.float32)
    answer = _run(runner, {"IN": x}, ["OUT"], batch=1)
    assert runner.sent == [("flat", {"X": (3,)})]
    assert answer["OUT"].shape == (1, 3)  # the batching ensemble's own batch dimension


# -- outputs not produced -------------------------------------------------------------------

PARTIAL = _ensemble(
    [_tensor("IN")],
    [_tensor("OUT1"), _tensor("OUT2"), _tensor("OUT3")],
    [
        _step("partial", {"X": "IN"}, {"Y1": "OUT1", "Y2": "y2"}),
        _step("reader", {"A": "OUT1", "B": "y2"}, {"S": "OUT2"}),
        _step("copy", {"X": "IN"}, {"Y": "OUT3"}),
    ],
    batch=8,
)


def _partial_runner(b_optional: bool) -> _InProcess:
    models = {
        "partial": _model("partial", [_tensor("X")], [_tensor("Y1"), _tensor("Y2")], 8),
        "reader": _model(
            "reader", [_tensor("A"), _tensor("B", optional=b_optional)], [_tensor("S")], 8
        ),
        "copy": _model("copy", [_tensor("X")], [_tensor("Y")], 8),
    }
    return _InProcess(
        PARTIAL,
        models,
        {
            "partial": lambda r: {"Y1": r["X"] + 1},  # never Y2
            "reader": lambda r: {"S": r["A"] + r.get("B", 0)},
            "copy": lambda r: {"Y": r["X"]},
        },
    )


def test_an_output_no_model_produced_is_left_out_of_the_answer() -> None:
    runner = _partial_runner(b_optional=True)
    x = np.ones((1, 3), np.float32)
    answer = _run(runner, {"IN": x}, ["OUT1", "OUT3"], batch=1)
    assert set(answer) == {"OUT1", "OUT3"}
    # The reader's optional input was not produced: it runs without it.
    answer = _run(runner, {"IN": x}, ["OUT1", "OUT2", "OUT3"], batch=1)
    assert set(answer) == {"OUT1", "OUT2", "OUT3"}
    assert ("reader", {"A": (1, 3)}) in runner.sent
    np.testing.assert_array_equal(answer["OUT2"], x + 1)


def test_a_required_input_not_produced_fails_the_step_with_tritons_text() -> None:
    runner = _partial_runner(b_optional=False)
    with pytest.raises(InvalidInput) as caught:
        _run(runner, {"IN": np.ones((1, 3), np.float32)}, ["OUT2"], batch=1)
    assert caught.value.message == (
        "in ensemble 'ens', step 1 (model 'reader'): [request id: req-1] expected 2 inputs "
        "but got 1 inputs for model 'reader'. Got input(s) ['A'], but missing required "
        "input(s) ['B']. Please provide all required input(s)."
    )
    assert [model for model, _ in runner.sent] == ["partial"]


def test_an_optional_ensemble_input_not_given_reaches_no_step() -> None:
    config = _ensemble(
        [_tensor("IN"), _tensor("EXTRA", optional=True)],
        [_tensor("OUT")],
        [_step("reader", {"A": "IN", "B": "EXTRA"}, {"S": "OUT"})],
        8,
    )
    reader = _model("reader", [_tensor("A"), _tensor("B", optional=True)], [_tensor("S")], 8)
    runner = _InProcess(config, {"reader": reader}, {"reader": lambda r: {"S": r["A"]}})
    answer = _run(runner, {"IN": np.ones((1, 3), np.float32)}, ["OUT"], batch=1)
    assert runner.sent == [("reader", {"A": (1, 3)})] and set(answer) == {"OUT"}


def test_joined_answers_name_the_outputs_a_request_lacks() -> None:
    a = {"OUT": np.ones((2, 3), np.float32), "MORE": np.ones((2, 1), np.float32)}
    b = {"OUT": np.full((1, 3), 2, np.float32)}
    joined = join_requests([a, b], [2, 1], ["OUT", "MORE"], {})
    assert isinstance(joined, PartialOutputs)
    assert absent_outputs(joined) == {1: frozenset({"MORE"})}
    assert joined["MORE"].shape == (3, 1) and joined["OUT"].shape == (3, 3)
    plain = join_requests([a, a], [2, 2], ["OUT"], {})
    assert plain is not None and absent_outputs(plain) == {}
    nobody = join_requests([b, b], [1, 1], ["OUT", "MORE"], {})
    assert nobody is not None and set(nobody) == {"OUT"} and absent_outputs(nobody) == {}
