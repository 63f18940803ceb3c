"""The sequences one instance holds, against a real Redis: a sequence that ENDs is closed at
once, so a request of it without START is refused even before the END's checkpoint is
deleted (the next batch may be admitted while the END's answer is still being recorded);
so is one that went idle while its checkpoint lingers; START opens it again; a state
output that is also a declared output stays in the answer; two tenants' sequences of one id
are two sequences; a correlation id the model's CORRID input cannot hold is refused alone."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from redis.asyncio import Redis

from sluice.core.config import parse_config_text
from sluice.core.keys import Keys
from sluice.core.sequences import sequence_of
from sluice.core.wire import RequestMessage
from sluice.scheduler.executor.redis_server import RedisServer
from sluice.workers import sequence_book
from sluice.workers.sequence_book import SequenceBook
from sluice.workers.tensors import PendingRequest

CONFIG = """
name: "counter"
backend: "python"
max_batch_size: 4
input [ { name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [
  { name: "TOTAL" data_type: TYPE_INT64 dims: [ 1 ] },
  { name: "COUNT_OUT" data_type: TYPE_INT64 dims: [ 1 ] }
]
sequence_batching {
  max_sequence_idle_microseconds: 60000000
  state [
    { input_name: "COUNT_IN" output_name: "COUNT_OUT" data_type: TYPE_INT64 dims: [ 1 ] },
    { input_name: "HIDDEN_IN" output_name: "HIDDEN_OUT" data_type: TYPE_INT64 dims: [ 1 ] }
  ]
}
"""

_entries = iter(range(1, 1_000_000))


CORRID_CONFIG = """
name: "counter"
backend: "python"
max_batch_size: 4
input [ { name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "TOTAL" data_type: TYPE_INT64 dims: [ 1 ] } ]
sequence_batching {
  control_input [
    { name: "CORRID" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_%s } ] }
  ]
}
"""


def _request(sequence_id: int | str, tenant: str = "", **flags: bool) -> PendingRequest:
    message = RequestMessage(
        request_key=uuid.uuid4().hex,
        reply_to="",
        inputs=[],
        outputs=["TOTAL", "COUNT_OUT"],
        parameters={"sequence_id": sequence_id, **flags},
        tenant=tenant,
    )
    return PendingRequest(f"{next(_entries)}-0".encode(), message, memoryview(b""), 1, ())


def _key(request: PendingRequest) -> str:
    """The name of the request's sequence in Redis keys."""
    return sequence_of(request.message.parameters, "counter", request.message.tenant).key


class _Instance:
    """A book and the Redis it checkpoints to, run the way a worker runs it."""

    def __init__(self, url: str, root: Path, config_text: str = CONFIG) -> None:
        self.redis = Redis.from_url(url)
        self.keys = Keys(f"t{uuid.uuid4().hex[:8]}")
        config = parse_config_text(config_text, model_name="counter")
        self.book = SequenceBook(config, root, self.redis, self.keys, 1)

    async def admit(self, request: PendingRequest) -> str:
        """ "ok", or the refusal's text."""
        admitted, refused = await self.book.admit([request])
        return "ok" if admitted else refused[0][1].message

    def compute(self, request: PendingRequest) -> dict[str, Any]:
        """The model (state + 1) on the compute thread; the outputs left to answer."""
        count = self.book.inputs([request])["COUNT_IN"]
        outputs = {"TOTAL": count + 1, "COUNT_OUT": count + 1, "HIDDEN_OUT": count * 2}
        self.book.update([request], outputs)
        return outputs

    async def record(self, request: PendingRequest) -> None:
        """The answer's transaction: its checkpoint (or the END's deletion)."""
        async with self.redis.pipeline(transaction=True) as pipe:
            self.book.write_checkpoints(pipe, [request])
            await pipe.execute()
        self.book.published([request])


Scenario = Callable[[_Instance], Awaitable[None]]


@pytest.fixture
def run(redis_server: RedisServer, tmp_path: Path) -> Callable[..., None]:
    """Runs a scenario with an instance (of ``config_text``, the counter's by default) made
    (and closed) on the scenario's event loop."""

    def run(scenario: Scenario, config_text: str = CONFIG) -> None:
        async def main() -> None:
            instance = _Instance(redis_server.url, tmp_path, config_text)
            try:
                await scenario(instance)
            finally:
                await instance.redis.aclose()

        asyncio.run(main())

    return run


def test_a_request_right_after_end_is_refused_before_the_end_is_recorded(
    run: Callable[[Scenario], None],
) -> None:
    async def scenario(instance: _Instance) -> None:
        start = _request(7, sequence_start=True)
        assert await instance.admit(start) == "ok"
        instance.compute(start)
        await instance.record(start)  # its checkpoint is in Redis
        end = _request(7, sequence_end=True)
        assert await instance.admit(end) == "ok"
        instance.compute(end)
        # The END's answer went out; its transaction (which deletes the checkpoint) has not
        # run yet when the next batch is admitted.
        late = _request(7)
        assert await instance.admit(late) == (
            "inference request for sequence 7 to model 'counter' must specify the START flag "
            "on the first request of the sequence"
        )
        await instance.record(end)
        key = instance.keys.sequence_state("counter", 1, _key(end))
        assert await instance.redis.exists(key) == 0
        assert "must specify the START flag" in await instance.admit(_request(7))
        again = _request(7, sequence_start=True)
        assert await instance.admit(again) == "ok"
        assert int(instance.compute(again)["TOTAL"][0, 0]) == 1  # a new sequence
        assert await instance.admit(_request(7)) == "ok"

    run(scenario)


def test_a_worker_taking_over_restores_a_sequence_from_its_checkpoint(
    run: Callable[[Scenario], None],
) -> None:
    """Closing is this process's knowledge: a new worker (no history) restores as before."""

    async def scenario(instance: _Instance) -> None:
        start = _request(9, sequence_start=True)
        await instance.admit(start)
        instance.compute(start)
        await instance.record(start)
        successor = SequenceBook(
            instance.book.config, instance.book.model_dir, instance.redis, instance.keys, 1
        )
        follow = _request(9)
        admitted, _ = await successor.admit([follow])
        assert admitted == [follow]
        assert successor.inputs([follow])["COUNT_IN"].tolist() == [[1]]

    run(scenario)


def test_a_sequence_gone_idle_stays_closed_while_its_checkpoint_lingers(
    run: Callable[[Scenario], None],
) -> None:
    async def scenario(instance: _Instance) -> None:
        start = _request(11, sequence_start=True)
        await instance.admit(start)
        instance.compute(start)
        await instance.record(start)  # a checkpoint that expires only in 60 s
        held = next(iter(instance.book._held.values()))
        held.last_seen -= instance.book.idle_s + 1  # idle longer than the model allows
        assert "must specify the START flag" in await instance.admit(_request(11))
        assert await instance.admit(_request(11, sequence_start=True)) == "ok"

    run(scenario)


def test_a_state_output_that_is_a_declared_output_is_answered(
    run: Callable[[Scenario], None],
) -> None:
    async def scenario(instance: _Instance) -> None:
        first = _request(13, sequence_start=True)
        await instance.admit(first)
        outputs = instance.compute(first)
        assert set(outputs) == {"TOTAL", "COUNT_OUT"}  # HIDDEN_OUT is the model's own
        np.testing.assert_array_equal(outputs["COUNT_OUT"], [[1]])
        second = _request(13)
        await instance.admit(second)
        tensors = instance.book.inputs([second])
        np.testing.assert_array_equal(tensors["COUNT_IN"], [[1]])
        np.testing.assert_array_equal(tensors["HIDDEN_IN"], [[0]])

    run(scenario)


def test_two_tenants_sequences_of_one_id_are_two_sequences(
    run: Callable[[Scenario], None],
) -> None:
    """Another tenant's request naming the id of a's running sequence neither joins it (nor
    reads its state) nor ends it; its START opens a sequence of its own."""

    async def scenario(instance: _Instance) -> None:
        start = _request(21, "team-a", sequence_start=True)
        assert await instance.admit(start) == "ok"
        instance.compute(start)
        await instance.record(start)
        assert "must specify the START flag" in await instance.admit(_request(21, "team-b"))
        ending = _request(21, "team-b", sequence_end=True)
        assert "must specify the START flag" in await instance.admit(ending)
        assert "must specify the START flag" in await instance.admit(_request(21))
        other = _request(21, "team-b", sequence_start=True)
        assert await instance.admit(other) == "ok"
        assert int(instance.compute(other)["TOTAL"][0, 0]) == 1  # b's own state
        follow = _request(21, "team-a")
        assert await instance.admit(follow) == "ok"
        assert int(instance.compute(follow)["TOTAL"][0, 0]) == 2  # a's, untouched by b
        assert _key(follow) != _key(other)

    run(scenario)


def test_a_correlation_id_the_corrid_input_cannot_hold_is_refused_alone(
    run: Callable[..., None],
) -> None:
    """An id of another kind than the model's CORRID, or too large for its type, is refused
    at admission (it failed its whole batch, or was computed with a wrong id); an id that
    fits in the type's bits reaches the model as Triton writes it."""

    async def scenario(instance: _Instance) -> None:
        good = _request(3_000_000_000, sequence_start=True)
        wide = _request(1 << 40, sequence_start=True)
        text = _request("abc", sequence_start=True)
        admitted, refused = await instance.book.admit([wide, good, text])
        assert admitted == [good]
        reasons = {request.message.parameters["sequence_id"]: exc for request, exc in refused}
        assert reasons[1 << 40].message == (
            f"inference request for sequence {1 << 40} to model 'counter': its CORRID "
            "control input is INT32, which cannot hold the correlation ID"
        )
        assert reasons["abc"].message == (
            "inference request for sequence abc to model 'counter': its CORRID control "
            "input is INT32, which takes integer correlation IDs, not strings"
        )
        corrid = instance.book.inputs([good])["CORRID"]
        assert corrid.dtype == np.int32 and corrid.tolist() == [[3_000_000_000 - (1 << 32)]]

    run(scenario, CORRID_CONFIG % "INT32")


def test_an_integer_correlation_id_reaches_a_string_corrid_as_its_text(
    run: Callable[..., None],
) -> None:
    async def scenario(instance: _Instance) -> None:
        number = _request(42, sequence_start=True)
        text = _request("x42", sequence_start=True)
        admitted, refused = await instance.book.admit([number, text])
        assert admitted == [number, text] and not refused
        assert instance.book.inputs([number, text])["CORRID"].tolist() == [[b"42"], [b"x42"]]

    run(scenario, CORRID_CONFIG % "STRING")


def test_a_large_id_on_an_int64_corrid_is_its_bits_read_as_signed(
    run: Callable[..., None],
) -> None:
    async def scenario(instance: _Instance) -> None:
        top = _request((1 << 64) - 1, sequence_start=True)
        admitted, _ = await instance.book.admit([top])
        assert admitted == [top]
        assert instance.book.inputs([top])["CORRID"].tolist() == [[-1]]

    run(scenario, CORRID_CONFIG % "INT64")


def test_only_the_sequences_idle_too_long_are_forgotten_among_many(
    run: Callable[[Scenario], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A thousand sequences started and left: those used since stay, the others close once
    idle longer than the model allows (the book looks at them oldest first)."""
    now = [1000.0]
    monkeypatch.setattr(sequence_book, "time", SimpleNamespace(monotonic=lambda: now[0]))

    async def scenario(instance: _Instance) -> None:
        book, idle_s = instance.book, instance.book.idle_s
        started = [_request(n, sequence_start=True) for n in range(1, 1001)]
        for first in range(0, 1000, 4):
            admitted, _ = await book.admit(started[first : first + 4])
            assert len(admitted) == 4
        now[0] += idle_s * 0.6
        used = [_request(n) for n in (3, 500, 999)]
        assert len((await book.admit(used))[0]) == 3
        now[0] += idle_s * 0.6  # the others are idle for longer than allowed now
        assert await instance.admit(_request(5000, sequence_start=True)) == "ok"
        assert len(book._held) == 4
        for n in (3, 500, 999):
            assert await instance.admit(_request(n)) == "ok"
        for n in (1, 4, 501, 1000):
            assert "must specify the START flag" in await instance.admit(_request(n))
        now[0] += idle_s * 1.1
        await instance.admit(_request(6000, sequence_start=True))
        # The thousand closed before have expired; the four that went idle now are closed.
        assert len(book._held) == 1
        assert book._closed.keys() == {_key(r) for r in [*used, _request(5000)]}

    run(scenario)
