"""A decoupled ensemble's request without Redis (:mod:`sluice.workers.backends.
ensemble_stream`): the steps after a decoupled model run once per response, the ensemble
answers in the order of the responses they come from even when later ones finish first,
the last answer is the final one (or an empty final when the decoupled model's empty final
comes last), a failing step ends the stream with its error, and nothing is kept after use."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest

from sluice.core.config import parse_config_text
from sluice.core.errors import InvalidConfig, InvalidInput
from sluice.workers.backends.base import RequestContext
from sluice.workers.backends.ensemble_backend import EnsembleBackend
from sluice.workers.backends.ensemble_check import composing_configs
from sluice.workers.backends.ensemble_stream import EnsembleStream, StepBound

_CONFIG = """
name: "tokens"
platform: "ensemble"
max_batch_size: 4
input [ { name: "N" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [
  { name: "ID" data_type: TYPE_INT32 dims: [ 1 ] },
  { name: "TEXT" data_type: TYPE_FP32 dims: [ 1 ] }
]
ensemble_scheduling { step [
  { model_name: "generate" model_version: -1 input_map { key: "N" value: "N" }
    output_map { key: "ID" value: "ID" } },
  { model_name: "detokenize" model_version: -1 input_map { key: "ID" value: "ID" }
    output_map { key: "TEXT" value: "TEXT" } }
] }
"""

_GENERATE = """
backend: "python" max_batch_size: 4
input [ { name: "N" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "ID" data_type: TYPE_INT32 dims: [ 1 ] } ]
model_transaction_policy { decoupled: true }
"""

_DETOKENIZE = """
backend: "python" max_batch_size: 4
input [ { name: "ID" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "TEXT" data_type: TYPE_FP32 dims: [ 1 ] } ]
"""


class _Model(EnsembleBackend):
    """The ensemble with its steps computed in-process: ``generate`` sends ids 0..N-1
    (then an empty final, or the last id as its final), ``detokenize`` takes longer for
    earlier ids, so they finish in reverse order."""

    def __init__(self, *, empty_final: bool = True, fail_at: int = -1) -> None:
        config = parse_config_text(_CONFIG, model_name="tokens")
        self.setup(
            config,
            [
                parse_config_text(_GENERATE, model_name="generate"),
                parse_config_text(_DETOKENIZE, model_name="detokenize"),
            ],
        )
        self.empty_final = empty_final
        self.fail_at = fail_at

    async def submit(
        self, index: int, reads: dict[str, np.ndarray], context: RequestContext
    ) -> dict[str, np.ndarray]:
        token = int(reads["ID"].reshape(-1)[0])
        await asyncio.sleep(0.002 * (5 - token))
        if token == self.fail_at:
            raise InvalidInput("no such token")
        return {"TEXT": reads["ID"].astype(np.float32) / 10}

    async def _responses(self, count: int) -> AsyncIterator[tuple[dict[str, np.ndarray], bool]]:
        for token in range(count):
            last = token == count - 1 and not self.empty_final
            yield {"ID": np.array([[token]], dtype=np.int32)}, last
            await asyncio.sleep(0)
        if self.empty_final:
            await asyncio.sleep(0.02)  # (after every detokenize step has finished)
            yield {}, True

    def submit_stream(
        self, index: int, reads: dict[str, np.ndarray], context: RequestContext
    ) -> AsyncIterator[tuple[dict[str, np.ndarray], bool]]:
        return self._responses(int(reads["N"].reshape(-1)[0]))


def _run(
    model: _Model, count: int, outputs: tuple[str, ...] = ("ID", "TEXT")
) -> tuple[list[dict[str, np.ndarray]], dict[str, np.ndarray] | None, EnsembleStream]:
    sent: list[dict[str, np.ndarray]] = []
    stream = EnsembleStream(model, outputs, RequestContext("r", 0, None), sent.append)
    n = np.array([[count]], dtype=np.int32)
    final = asyncio.run(stream.run({"N": n}, 1))
    return sent, final, stream


def _ids(answers: list[dict[str, np.ndarray]]) -> list[int]:
    return [int(a["ID"].reshape(-1)[0]) for a in answers]


def test_answers_follow_the_decoupled_models_order_and_an_empty_final_ends_them() -> None:
    sent, final, stream = _run(_Model(empty_final=True), 5)
    assert _ids(sent) == [0, 1, 2, 3, 4]
    assert [float(a["TEXT"].reshape(-1)[0]) for a in sent] == pytest.approx(
        [0.0, 0.1, 0.2, 0.3, 0.4]
    )
    assert final is None  # the decoupled model's empty final came after every answer
    assert all(not values for values in stream._values.values())  # nothing kept


def test_the_last_answer_is_the_final_one_when_nothing_can_follow_it() -> None:
    sent, final, _ = _run(_Model(empty_final=False), 3)
    assert _ids(sent) == [0, 1]
    assert final is not None and _ids([final]) == [2]


def test_only_the_steps_an_answer_needs_run_and_no_responses_means_an_empty_final() -> None:
    sent, final, _ = _run(_Model(), 3, outputs=("ID",))
    assert _ids(sent) == [0, 1, 2] and final is None
    sent, final, _ = _run(_Model(), 0)
    assert sent == [] and final is None


def test_a_failing_step_ends_the_stream_with_its_error() -> None:
    with pytest.raises(InvalidInput) as info:
        _run(_Model(fail_at=3), 5)
    assert info.value.message == (
        "in ensemble 'tokens', step 1 (model 'detokenize'): no such token"
    )


def test_a_step_that_reads_responses_with_other_tensors_fails_the_load(tmp_path: Path) -> None:
    """Which of ``generate``'s responses would go with the request's own input is not
    defined: Triton refuses such an ensemble when it loads, with this text."""
    for name, text in (("generate", _GENERATE), ("detokenize", _DETOKENIZE)):
        (tmp_path / name / "1").mkdir(parents=True)
        (tmp_path / name / "1" / "model.py").write_text("class Model: ...\n")
        (tmp_path / name / "config.pbtxt").write_text(text)
    (tmp_path / "join" / "1").mkdir(parents=True)
    (tmp_path / "join" / "1" / "model.py").write_text("class Model: ...\n")
    (tmp_path / "join" / "config.pbtxt").write_text(
        'backend: "python" max_batch_size: 4 '
        'input [ { name: "A" data_type: TYPE_INT32 dims: [ 1 ] }, '
        '{ name: "B" data_type: TYPE_INT32 dims: [ 1 ] } ] '
        'output [ { name: "C" data_type: TYPE_FP32 dims: [ 1 ] } ]'
    )
    mixed = _CONFIG.replace(
        '{ model_name: "detokenize" model_version: -1 input_map { key: "ID" value: "ID" }\n'
        '    output_map { key: "TEXT" value: "TEXT" } }',
        '{ model_name: "join" model_version: -1 input_map { key: "A" value: "ID" }\n'
        '    input_map { key: "B" value: "N" } output_map { key: "C" value: "TEXT" } }',
    )
    assert mixed != _CONFIG
    with pytest.raises(InvalidConfig) as info:
        composing_configs(parse_config_text(mixed, model_name="tokens"), tmp_path)
    assert info.value.message == (
        "in ensemble tokens, step of model 'join' receives inputs originated from different "
        "decoupled models"
    )
    accepted = composing_configs(parse_config_text(_CONFIG, model_name="tokens"), tmp_path)
    assert [config.decoupled for config in accepted] == [True, False]


def test_a_cancelled_request_withdraws_the_decoupled_models_request() -> None:
    """Cancelling the run (its caller went away) closes the decoupled step's response
    stream, which withdraws its request (:meth:`sluice.workers.model_calls.ModelCalls.
    submit_stream`), and cancels the steps after it."""
    closed: list[str] = []

    class _Endless(_Model):
        async def _responses(self, count: int) -> AsyncIterator[tuple[dict[str, np.ndarray], bool]]:
            try:
                token = 0
                while True:
                    yield {"ID": np.array([[token % 5]], dtype=np.int32)}, False
                    token += 1
                    await asyncio.sleep(0.001)
            finally:
                closed.append("generate")

    async def cancel_after_three() -> list[dict[str, np.ndarray]]:
        sent: list[dict[str, np.ndarray]] = []
        stream = EnsembleStream(_Endless(), ("ID",), RequestContext("r", 0, None), sent.append)
        run = asyncio.create_task(stream.run({"N": np.array([[1]], dtype=np.int32)}, 1))
        while len(sent) < 3:
            await asyncio.sleep(0.001)
        run.cancel()
        with pytest.raises(asyncio.CancelledError):
            await run
        await asyncio.sleep(0.01)  # (the step's own cancellation runs its generator's end)
        assert all(task.done() for task in stream._tasks)
        return sent

    sent = asyncio.run(cancel_after_three())
    assert _ids(sent[:3]) == [0, 1, 2]
    assert closed == ["generate"]


class _Fast(_Model):
    """``generate`` answers as fast as it is asked (``count`` ids, counting what it sent),
    ``detokenize`` takes 1 ms per id; one request in flight per step (``in_flight``)."""

    def __init__(self, in_flight: int) -> None:
        super().__init__(empty_final=True)
        self.in_flight = in_flight
        self._limits = [StepBound(in_flight) for _ in self.steps]
        self.taken = 0
        self.detokenized = 0
        self.most_ahead = 0

    async def submit(
        self, index: int, reads: dict[str, np.ndarray], context: RequestContext
    ) -> dict[str, np.ndarray]:
        await asyncio.sleep(0.001)
        self.detokenized += 1
        return {"TEXT": reads["ID"].astype(np.float32)}

    async def _responses(self, count: int) -> AsyncIterator[tuple[dict[str, np.ndarray], bool]]:
        for token in range(count):
            self.taken += 1
            self.most_ahead = max(self.most_ahead, self.taken - self.detokenized)
            yield {"ID": np.array([[token]], dtype=np.int32)}, False
        yield {}, True


@pytest.mark.parametrize("in_flight", [1, 4])
def test_a_decoupled_model_faster_than_the_next_step_is_held_back(in_flight: int) -> None:
    """Triton's ``max_inflight_requests``: the responses a decoupled model has sent and the
    step after it has not finished stay within the bound (plus the one being handed on),
    instead of one waiting task per response."""
    model = _Fast(in_flight)
    sent, final, stream = _run(model, 200)
    assert _ids(sent + ([final] if final is not None else [])) == list(range(200))
    assert model.most_ahead <= in_flight + 1, model.most_ahead
    assert not stream._working and not stream._holding


_CHAIN = """
name: "chain"
platform: "ensemble"
max_batch_size: 4
input [ { name: "N" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "TEXT" data_type: TYPE_FP32 dims: [ 1 ] } ]
ensemble_scheduling { step [
  { model_name: "generate" model_version: -1 input_map { key: "N" value: "N" }
    output_map { key: "ID" value: "ID" } },
  { model_name: "split" model_version: -1 input_map { key: "N" value: "ID" }
    output_map { key: "ID" value: "PART" } },
  { model_name: "detokenize" model_version: -1 input_map { key: "ID" value: "PART" }
    output_map { key: "TEXT" value: "TEXT" } }
] }
"""


class _Chain(_Fast):
    """Two decoupled steps in a row (``split`` sends two parts per id), one place each:
    a decoupled step further on holds the only place of its step while the first waits."""

    def __init__(self) -> None:
        super().__init__(1)
        decoupled = parse_config_text(_GENERATE, model_name="split")
        self.setup(
            parse_config_text(_CHAIN, model_name="chain"),
            [self.step_configs[0], decoupled, self.step_configs[1]],
        )
        self.in_flight = 1
        self._limits = [StepBound(1) for _ in self.steps]

    def submit_stream(
        self, index: int, reads: dict[str, np.ndarray], context: RequestContext
    ) -> AsyncIterator[tuple[dict[str, np.ndarray], bool]]:
        if index == 0:
            return self._responses(int(reads["N"].reshape(-1)[0]))
        return self._parts(int(reads["N"].reshape(-1)[0]))

    async def _parts(self, token: int) -> AsyncIterator[tuple[dict[str, np.ndarray], bool]]:
        yield {"ID": np.array([[token * 10]], dtype=np.int32)}, False
        yield {"ID": np.array([[token * 10 + 1]], dtype=np.int32)}, True


def test_chained_decoupled_steps_with_one_place_each_do_not_wait_on_each_other() -> None:
    model = _Chain()

    async def run() -> list[dict[str, np.ndarray]]:
        sent: list[dict[str, np.ndarray]] = []
        stream = EnsembleStream(model, ("TEXT",), RequestContext("r", 0, None), sent.append)
        final = await asyncio.wait_for(stream.run({"N": np.array([[20]], dtype=np.int32)}, 1), 30)
        return sent + ([final] if final is not None else [])

    answers = asyncio.run(run())
    texts = [float(a["TEXT"].reshape(-1)[0]) for a in answers]
    assert texts == [float(t * 10 + part) for t in range(20) for part in (0, 1)]
