"""The batching loop against an in-memory intake and a clock of the test's own.

No Redis, no model, no sleeping: the intake hands out requests that have "arrived" by the
test clock's time, and a wait for more moves the clock to the next arrival (or to the end
of the wait).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest

from sluice.core.config.parse import parse_config_text
from sluice.core.wire import RequestMessage
from sluice.workers.adaptive import BatchPolicy
from sluice.workers.batcher import Batcher, DynamicBatcher, SequenceBatcher
from sluice.workers.loading import batching_of
from sluice.workers.replies import BatchClose
from sluice.workers.slots import ComputeGate
from sluice.workers.tensors import PendingRequest

BACKGROUND = 2
"""Two online levels (0, 1), then the background stream."""


@dataclass
class Clock:
    now: float = 100.0

    def __call__(self) -> float:
        return self.now


@dataclass
class MemoryIntake:
    """Requests that arrive at given times on the test clock."""

    clock: Clock
    scheduled: list[tuple[float, PendingRequest]] = field(default_factory=list)
    reclaimed: list[PendingRequest] = field(default_factory=list)
    waits: list[float] = field(default_factory=list)
    """Each ``read_within``'s wait (seconds)."""

    def arrive(self, *requests: PendingRequest, at: float | None = None) -> None:
        when = self.clock.now if at is None else at
        self.scheduled += [(when, r) for r in requests]

    def _due(self, online_only: bool) -> list[tuple[float, PendingRequest]]:
        return [
            (when, r)
            for when, r in self.scheduled
            if when <= self.clock.now and not (online_only and r.level == BACKGROUND)
        ]

    def _take(self, count: int, online_only: bool) -> list[PendingRequest]:
        taken = self._due(online_only)[: max(1, count)]
        for item in taken:
            self.scheduled.remove(item)
        return [r for _, r in taken]

    def _advance(self, seconds: float) -> None:
        upcoming = [when for when, _ in self.scheduled if when > self.clock.now]
        end = self.clock.now + max(0.0, seconds)
        self.clock.now = min([end, *upcoming])

    async def read(
        self, count: int, block_ms: int | None, *, background: bool = True
    ) -> list[PendingRequest]:
        await asyncio.sleep(0)  # a read yields to the event loop, as a Redis call does
        if block_ms is not None and not self._due(not background):
            self._advance(block_ms / 1000)
        return self._take(count, not background)

    async def read_online(self, count: int) -> list[PendingRequest]:
        await asyncio.sleep(0)
        return self._take(count, True)

    async def read_within(
        self, count: int, wait_s: float, *, background: bool
    ) -> list[PendingRequest]:
        await asyncio.sleep(0)
        self.waits.append(wait_s)
        self._advance(wait_s)
        return self._take(count, not background)

    def take_reclaimed(self) -> list[PendingRequest]:
        taken, self.reclaimed = self.reclaimed, []
        return taken


_ids = iter(range(1, 1_000_000))


def request(
    level: int = 0,
    *,
    items: int = 1,
    deadline_ns: int = 0,
    sequence: int | None = None,
    shape: tuple[int, ...] = (4,),
) -> PendingRequest:
    number = next(_ids)
    parameters = {} if sequence is None else {"sequence_id": sequence}
    message = RequestMessage(
        f"r{number}", "", [], ["y"], deadline_ns=deadline_ns, parameters=parameters
    )
    entry = f"{number}-0".encode()
    return PendingRequest(entry, message, memoryview(b""), items, (("x", shape),), "", level)


def names(requests: list[PendingRequest]) -> list[str]:
    return [r.message.request_key for r in requests]


def free_gate() -> asyncio.Event:
    gate = asyncio.Event()
    gate.set()
    return gate


def dynamic(
    intake: MemoryIntake,
    *,
    limit: int = 8,
    window_s: float = 0.01,
    adaptive: bool = False,
    deadline_order: bool = False,
    preferred: tuple[int, ...] = (),
    drain: bool = False,
) -> DynamicBatcher:
    return DynamicBatcher(
        intake,
        BatchPolicy(window_s, adaptive),
        deadline_order=deadline_order,
        max_batch_size=limit,
        background_level=BACKGROUND,
        stopping=asyncio.Event(),
        drain=drain,
        preferred_sizes=preferred,
        clock=intake.clock,
    )


# -- choosing a batch ----------------------------------------------------------------------


def test_the_highest_priority_level_goes_first_then_arrival_order() -> None:
    batcher = dynamic(MemoryIntake(Clock()), limit=3)
    low, high_a, background, mid, high_b = (
        request(1),
        request(0),
        request(BACKGROUND),
        request(1),
        request(0),
    )
    chosen = batcher.select([low, high_a, background, mid, high_b])
    assert names(chosen.batch) == names([high_a, high_b, low])
    assert names(chosen.rest) == names([mid, background])
    assert chosen.full


def test_adaptive_batching_serves_a_level_by_earliest_deadline() -> None:
    batcher = dynamic(MemoryIntake(Clock()), limit=2, deadline_order=True)
    late, none, soon, urgent_low = (
        request(deadline_ns=300),
        request(),
        request(deadline_ns=100),
        request(1, deadline_ns=1),
    )
    chosen = batcher.select([late, none, soon, urgent_low])
    assert names(chosen.batch) == names([soon, late])
    assert names(chosen.rest) == names([none, urgent_low])  # no deadline: after every one


def test_preserve_ordering_keeps_arrival_order() -> None:
    batcher = dynamic(MemoryIntake(Clock()), limit=2, deadline_order=False)
    late, soon = request(deadline_ns=300), request(deadline_ns=100)
    assert names(batcher.select([late, soon]).batch) == names([late, soon])


@pytest.mark.parametrize(
    ("extra", "deadline_order"),
    [
        ("dynamic_batching { }", True),
        ("dynamic_batching { preserve_ordering: true }", False),
        (
            'dynamic_batching { }\nparameters { key: "adaptive_batching" '
            'value: { string_value: "false" } }',
            False,
        ),
        ("sequence_batching { }", False),
    ],
)
def test_the_config_decides_between_deadline_and_arrival_order(
    extra: str, deadline_order: bool
) -> None:
    config = parse_config_text(
        f"""
        name: "m"
        platform: "onnxruntime_onnx"
        max_batch_size: 8
        input [ {{ name: "x" data_type: TYPE_FP32 dims: [ -1 ] }} ]
        output [ {{ name: "y" data_type: TYPE_FP32 dims: [ -1 ] }} ]
        {extra}
        """,
        model_name="m",
    )
    assert batching_of(config)[1] is deadline_order


def test_a_batch_holds_one_shape_and_closes_at_the_first_request_that_does_not_fit() -> None:
    batcher = dynamic(MemoryIntake(Clock()), limit=4)
    big, wide, too_many, small = (
        request(items=2),
        request(shape=(8,)),
        request(items=3),
        request(items=1),
    )
    chosen = batcher.select([big, wide, too_many, small])
    assert names(chosen.batch) == names([big])  # no request overtakes one that did not fit
    assert names(chosen.rest) == names([wide, too_many, small])
    assert chosen.full
    behind_another_shape = [request(items=2), request(shape=(8,)), request(items=1)]
    adaptive = dynamic(MemoryIntake(Clock()), limit=4, adaptive=True)
    fits = adaptive.select(list(behind_another_shape))
    assert [r.items for r in fits.batch] == [2, 1] and not fits.full
    # Without adaptive batching, as Triton's: the other shape closes the batch at once.
    tritons = batcher.select(list(behind_another_shape))
    assert [r.items for r in tritons.batch] == [2] and tritons.full


def test_without_adaptive_batching_more_than_the_largest_preferred_size_goes_at_once() -> None:
    batcher = dynamic(MemoryIntake(Clock()), limit=16, preferred=(4, 8))
    chosen = batcher.select([request() for _ in range(11)])
    assert (len(chosen.batch), len(chosen.rest), chosen.full) == (8, 3, True)
    # No preferred size reached under the largest: as many as stay under it.
    odd = batcher.select([request(items=3), request(items=3), request(items=3)])
    assert ([r.items for r in odd.batch], odd.full) == ([3, 3], True)
    # Up to the largest preferred size, the batch waits (or closes at a preferred size).
    assert not batcher.select([request() for _ in range(6)]).full
    adaptive = dynamic(MemoryIntake(Clock()), limit=16, preferred=(4, 8), adaptive=True)
    assert len(adaptive.select([request() for _ in range(11)]).batch) == 11


def test_a_sequence_batch_takes_one_request_per_sequence_in_arrival_order() -> None:
    batcher = SequenceBatcher(
        MemoryIntake(Clock()),
        BatchPolicy(0.01, False),
        max_batch_size=8,
        background_level=1,
        stopping=asyncio.Event(),
    )
    a1, b1, a2, c1, a3 = (
        request(sequence=1, deadline_ns=9),
        request(sequence=2, deadline_ns=5),
        request(sequence=1),
        request(sequence=3, deadline_ns=1),
        request(sequence=1),
    )
    chosen = batcher.select([a1, b1, a2, c1, a3])
    assert names(chosen.batch) == names([a1, b1, c1])
    assert names(chosen.rest) == names([a2, a3])  # their sequence's order kept
    assert not chosen.full


def test_the_dynamic_batcher_puts_requests_of_one_sequence_together() -> None:
    batcher = dynamic(MemoryIntake(Clock()))
    assert len(batcher.select([request(sequence=1), request(sequence=1)]).batch) == 2


# -- why a batch closes --------------------------------------------------------------------


async def test_a_batch_closes_at_max_batch_size() -> None:
    intake = MemoryIntake(Clock())
    intake.arrive(*(request() for _ in range(3)))
    batch, rest, close = await dynamic(intake, limit=2).gather([], free_gate())
    assert (len(batch), rest, close.reason) == (2, [], "full")
    assert len(intake.scheduled) == 1  # left in the stream, for the model's other instances


async def test_a_batch_closes_at_a_preferred_size() -> None:
    intake = MemoryIntake(Clock())
    intake.arrive(request(), request())
    intake.arrive(request(), at=intake.clock.now + 0.001)
    batch, _, close = await dynamic(intake, preferred=(2,)).gather([], free_gate())
    assert (len(batch), close.reason) == (2, "preferred")
    assert intake.waits == []


async def test_a_batch_closes_when_the_queue_delay_is_over() -> None:
    clock = Clock()
    intake = MemoryIntake(clock)
    intake.arrive(request())
    intake.arrive(request(), at=clock.now + 0.004)
    intake.arrive(request(), at=clock.now + 0.5)  # too late for this batch
    opened = clock.now
    batch, _, close = await dynamic(intake, window_s=0.01).gather([], free_gate())
    assert (len(batch), close.reason) == (2, "window")
    assert close.opened == opened and clock.now == pytest.approx(opened + 0.01)


async def test_a_batch_with_under_a_millisecond_left_reads_once_more_then_goes() -> None:
    clock = Clock()
    intake = MemoryIntake(clock)
    intake.arrive(request())
    opened = clock.now
    batch, _, close = await dynamic(intake, window_s=0.0005).gather([], free_gate())
    assert (len(batch), close.reason) == (1, "window")
    assert intake.waits == [pytest.approx(0.0005)]  # one look, not one per event-loop turn
    assert clock.now == pytest.approx(opened + 0.0005)


async def test_adaptive_batching_sends_a_lone_request_at_once_under_light_traffic() -> None:
    intake = MemoryIntake(Clock())
    intake.arrive(request())
    batch, _, close = await dynamic(intake, window_s=1.0, adaptive=True).gather([], free_gate())
    assert (len(batch), close.reason) == (1, "adaptive")
    assert intake.waits == []


async def test_a_stopping_worker_closes_the_batch_it_holds() -> None:
    intake = MemoryIntake(Clock())
    batcher = dynamic(intake)
    batcher.stopping.set()
    held = [request()]
    batch, _, close = await batcher.gather(held, free_gate())
    assert (names(batch), close.reason) == (names(held), "stopping")
    assert await batcher.gather([], free_gate()) == ([], [], BatchClose("stopping", 100.0))


async def test_draining_closes_the_batch_once_nothing_more_arrives() -> None:
    intake = MemoryIntake(Clock())
    intake.arrive(request())
    batch, _, close = await dynamic(intake, window_s=10.0, drain=True).gather([], free_gate())
    assert (len(batch), close.reason) == (1, "window")


async def test_an_idle_read_that_finds_nothing_closes_an_empty_batch() -> None:
    batch, rest, close = await dynamic(MemoryIntake(Clock())).gather([], free_gate())
    assert (batch, rest, close.reason) == ([], [], "window")


async def test_requests_taken_over_from_dead_workers_join_the_next_batch() -> None:
    intake = MemoryIntake(Clock())
    intake.reclaimed = [request(), request()]
    batch, _, close = await dynamic(intake, limit=2).gather([], free_gate())
    assert (len(batch), close.reason) == (2, "full")


async def test_while_the_compute_slot_is_busy_the_batch_only_grows() -> None:
    intake = MemoryIntake(Clock())
    intake.arrive(request())
    gate = asyncio.Event()  # the last batch still computes
    batcher = dynamic(intake, window_s=0.0)

    def last_batch_done() -> None:
        intake.arrive(request())
        gate.set()

    asyncio.get_running_loop().call_soon(last_batch_done)
    batch, _, close = await batcher.gather([], gate)
    assert (len(batch), close.reason) == (2, "window")


# -- background traffic yields to online traffic -------------------------------------------


async def test_held_background_requests_yield_to_online_ones_that_arrived() -> None:
    intake = MemoryIntake(Clock())
    online = request(1)
    intake.arrive(online)
    background = request(BACKGROUND)
    batch, rest, close = await dynamic(intake, limit=1).gather([background], free_gate())
    assert (names(batch), names(rest), close.reason) == (
        names([online]),
        names([background]),
        "full",
    )


def test_a_background_batch_is_always_looked_at_again_an_online_one_only_with_deadlines() -> None:
    batcher = dynamic(MemoryIntake(Clock()), limit=4)
    assert batcher.look_again([request(BACKGROUND)], [], computing=False)
    assert not batcher.look_again([request(0)], [], computing=True)
    ordered = dynamic(MemoryIntake(Clock()), limit=4, deadline_order=True)
    assert ordered.look_again([request(0)], [], computing=True)
    assert not ordered.look_again([request(0)], [], computing=False)
    assert not ordered.look_again([request(0)], [request() for _ in range(4)], computing=True)
    ordered.stopping.set()
    assert not ordered.look_again([request(BACKGROUND)], [], computing=True)


async def test_serving_runs_online_requests_that_arrived_before_a_formed_background_batch() -> None:
    intake = MemoryIntake(Clock())
    background, online = request(BACKGROUND), request(0)
    intake.arrive(background)
    batcher = dynamic(intake, limit=1, drain=True)
    ran: list[list[str]] = []

    async def execute(batch: list[PendingRequest], close: BatchClose, gate: ComputeGate) -> None:
        ran.append(names(batch))
        gate.set()

    gate = asyncio.Event()  # a batch computes while the background one forms

    def computed() -> None:
        intake.arrive(online)
        gate.set()

    asyncio.get_running_loop().call_soon(computed)
    await batcher.serve(execute, gate)
    assert ran == [names([online]), names([background])]


async def test_serving_stops_when_asked_and_nothing_is_left() -> None:
    intake = MemoryIntake(Clock())
    batcher: Batcher = dynamic(intake)
    batcher.stopping.set()
    ran: list[list[PendingRequest]] = []

    async def execute(batch: list[PendingRequest], close: BatchClose, gate: ComputeGate) -> None:
        ran.append(batch)

    await batcher.serve(execute, free_gate())
    assert ran == []


async def test_a_batch_starts_before_the_next_read_goes_out() -> None:
    """A batch that computes on the event loop sends its answers at once; the read for the
    next batch (which may wait, blocking, for a long time) comes after, not before."""
    intake = MemoryIntake(Clock())
    intake.arrive(request())
    batcher = dynamic(intake, limit=1, drain=True)
    events: list[str] = []
    read = intake.read

    async def logged_read(
        count: int, block_ms: int | None, *, background: bool = True
    ) -> list[PendingRequest]:
        events.append("read")
        return await read(count, block_ms, background=background)

    intake.read = logged_read  # type: ignore[method-assign]

    async def execute(batch: list[PendingRequest], close: BatchClose, gate: ComputeGate) -> None:
        events.append("answers sent")  # (computed inline: no wait before its answers go)
        gate.set()

    await batcher.serve(execute, free_gate())
    assert events[:3] == ["read", "answers sent", "read"]
