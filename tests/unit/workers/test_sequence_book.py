"""The sequences one instance holds, against a real Redis: a sequence that ENDs is closed at
once, so a request of it without START is refused even before the END's checkpoint is
deleted (the next batch may be admitted while the END's answer is still being recorded);
so is one that went idle while its checkpoint lingers; START opens it again; a state
output that is also a declared output stays in the answer."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from redis.asyncio import Redis

from sluice.core.config import parse_config_text
from sluice.core.keys import Keys
from sluice.core.sequences import sequence_of
from sluice.core.wire import RequestMessage
from sluice.scheduler.executor.redis_server import RedisServer
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


def _request(sequence_id: int, **flags: bool) -> PendingRequest:
    message = RequestMessage(
        request_key=uuid.uuid4().hex,
        reply_to="",
        inputs=[],
        outputs=["TOTAL", "COUNT_OUT"],
        parameters={"sequence_id": sequence_id, **flags},
    )
    return PendingRequest(f"{next(_entries)}-0".encode(), message, memoryview(b""), 1, ())


def _key(request: PendingRequest) -> str:
    """The name of the request's sequence in Redis keys."""
    return sequence_of(request.message.parameters, "counter").key


class _Instance:
    """A book and the Redis it checkpoints to, run the way a worker runs it."""

    def __init__(self, url: str, root: Path) -> None:
        self.redis = Redis.from_url(url)
        self.keys = Keys(f"t{uuid.uuid4().hex[:8]}")
        config = parse_config_text(CONFIG, model_name="counter")
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
def run(redis_server: RedisServer, tmp_path: Path) -> Callable[[Scenario], None]:
    """Runs a scenario with an instance made (and closed) on the scenario's event loop."""

    def run(scenario: Scenario) -> None:
        async def main() -> None:
            instance = _Instance(redis_server.url, tmp_path)
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
