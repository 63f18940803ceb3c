"""Forming batches: which held requests go together, and when the batch closes.

The loop blocks for the first request, then keeps filling the batch until it is full,
reaches a preferred size, waiting no longer pays (:mod:`sluice.workers.adaptive`), or the first
request has waited the queue delay; it goes when a compute slot is free. While one batch
computes, the loop already gathers the next.

Two batchers share that loop and differ in how they choose a batch from what is held, as
the two kinds of model differ:

- :class:`DynamicBatcher`: highest priority level first; within a level the tenants take
  turns by weight (:mod:`sluice.workers.fair_share`), and each tenant's requests go in
  arrival order, or earliest deadline first under adaptive batching (unless the config asks
  for ``preserve_ordering``).
- :class:`SequenceBatcher`: arrival order always, and at most one request of a sequence
  per batch (the next one needs the state this one leaves).

In both, the background stream (jobs, batch jobs) is the lowest level and yields to online
traffic: a batch of background requests formed while the last batch computed is chosen
again from what arrived meanwhile. The batcher reads requests only through an
:class:`~sluice.workers.intake.Intake`, and time only through ``clock``, so it runs
against an in-memory intake in tests.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Collection, Coroutine
from dataclasses import dataclass
from typing import Any

from sluice.workers.adaptive import BatchPolicy
from sluice.workers.fair_share import FairShare
from sluice.workers.intake import Intake
from sluice.workers.replies import BatchClose
from sluice.workers.slots import ComputeGate
from sluice.workers.tensors import PendingRequest

NO_DEADLINE_NS = 1 << 62
"""A request without a deadline sorts after every request with one."""

SHORT_WAIT_S = 0.001
"""A batch whose window has less than this left, and that found nothing more in its last
read, goes at once (the window is an upper bound): the event loop cannot sleep so briefly,
and reading until the window's end would only read nothing again."""

Execute = Callable[[list[PendingRequest], BatchClose, ComputeGate], Coroutine[Any, Any, None]]
"""Runs one batch; gives its compute slot back (``gate.set()``) once the next batch may go."""


@dataclass
class Selection:
    batch: list[PendingRequest]
    rest: list[PendingRequest]
    """Held for a later batch."""
    full: bool
    """The batch reached ``max_batch_size``, or a request of its shape did not fit."""


class Batcher:
    """The gathering loop shared by both batchers; subclasses say how a batch is chosen
    (:meth:`order`, :meth:`admission`)."""

    deadline_order = False
    """Within a priority level, earliest deadline first (else arrival order)."""

    def __init__(
        self,
        intake: Intake,
        policy: BatchPolicy,
        *,
        max_batch_size: int,
        background_level: int,
        stopping: asyncio.Event,
        drain: bool = False,
        preferred_sizes: Collection[int] = (),
        idle_block_ms: int = 500,
        clock: Callable[[], float] = time.monotonic,
        fair_share: FairShare | None = None,
    ) -> None:
        """``background_level``: the level of the background stream (the lowest).
        ``drain``: :meth:`serve` returns once the intake is empty (tests, batch runs).
        ``idle_block_ms``: how long one read of an idle worker blocks.
        ``clock``: monotonic seconds (a test's own clock).
        ``fair_share``: share each level between tenants by weight (None: arrival order)."""
        self.intake = intake
        self.policy = policy
        self.limit = max(1, max_batch_size)
        self.background_level = background_level
        self.stopping = stopping
        self.drain = drain
        self.preferred_sizes = frozenset(preferred_sizes)
        self.idle_block_ms = idle_block_ms
        self.clock = clock
        self.fair_share = fair_share

    # -- choosing a batch ------------------------------------------------------------------

    def order(self, pending: list[PendingRequest]) -> None:
        """Sort ``pending`` (in place, stably) in the order requests are served."""
        if self.deadline_order:
            pending.sort(key=lambda r: (r.level, r.message.deadline_ns or NO_DEADLINE_NS))
        else:
            pending.sort(key=lambda r: r.level)
        if self.fair_share is not None:
            self.fair_share.interleave(pending)

    def admission(self) -> Callable[[PendingRequest], bool]:
        """For one selection: whether a request may join the batch at all (else it waits)."""
        return lambda request: True

    def select(self, pending: list[PendingRequest]) -> Selection:
        """The next batch (in :meth:`order`; all of the first request's shape), the rest,
        and whether the batch is full.

        Without adaptive batching the batch closes as Triton's dynamic batcher closes it:
        at the first request in order that cannot join (another shape, or too many items),
        with nothing behind it overtaking; and once more items wait than the largest
        preferred size, it goes at once with the largest preferred size they reach
        (else as many as fit under it)."""
        self.order(pending)
        admits = self.admission()
        tritons = not self.policy.adaptive
        key = pending[0].key
        batch: list[PendingRequest] = []
        rest: list[PendingRequest] = []
        items, full = 0, False
        for request in pending:
            if not admits(request):
                rest.append(request)
            elif request.key == key and items + request.items <= self.limit and not full:
                batch.append(request)
                items += request.items
            else:
                if request.key == key or tritons:
                    full = True
                rest.append(request)
        if not batch:
            # One request over the limit cannot happen (the gateway checks); never stall anyway.
            batch, rest = [pending[0]], pending[1:]
        if tritons and self.preferred_sizes and items > max(self.preferred_sizes):
            kept = self._preferred_prefix(batch)
            batch, rest = batch[:kept], batch[kept:] + rest
            full = True
        return Selection(batch, rest, full or items >= self.limit)

    def _preferred_prefix(self, batch: list[PendingRequest]) -> int:
        """How many of ``batch``'s requests make the largest preferred size it reaches, or
        else the most that stay under the largest preferred size (at least one)."""
        largest = max(self.preferred_sizes)
        reached, under, items = 0, 0, 0
        for count, request in enumerate(batch, start=1):
            items += request.items
            if items > largest:
                break
            under = count
            if items in self.preferred_sizes:
                reached = count
        return reached or under or 1

    # -- the gathering loop ----------------------------------------------------------------

    async def gather(
        self, carry: list[PendingRequest], gate: ComputeGate
    ) -> tuple[list[PendingRequest], list[PendingRequest], BatchClose]:
        """The next batch, the requests left for later, and why the batch closed."""
        limit, policy, intake = self.limit, self.policy, self.intake
        first = self.clock()
        pending = carry + intake.take_reclaimed()
        if not pending:
            if self.stopping.is_set():
                return [], [], BatchClose("stopping", first)
            pending = await intake.read(limit, None if self.drain else self.idle_block_ms)
            if not pending:
                return [], [], BatchClose("window", first)
            first = self.clock()
        elif any(r.level == self.background_level for r in pending) and not self.stopping.is_set():
            pending += await intake.read_online(limit)  # they go first (sorted by level)
        elif self.fair_share is not None and not self.stopping.is_set():
            # Tenants take turns: a tenant whose requests arrived must not wait until what
            # this worker holds of the others is gone, so read again the streams it holds
            # less than a batch of (nothing to read without tenant streams).
            pending += await self.top_up(pending)
        while True:
            chosen = self.select(pending)
            batch, rest = chosen.batch, chosen.rest
            items = sum(r.items for r in batch)
            now = self.clock()
            waited = now - first
            if chosen.full:
                return batch, rest, BatchClose("full", first)
            if self.stopping.is_set():
                return batch, rest, BatchClose("stopping", first)
            if gate.is_set():
                reason = (
                    "preferred"
                    if items in self.preferred_sizes
                    else policy.close(items, waited, now)
                )
                if reason is not None:
                    return batch, rest, BatchClose(reason, first)
            if not gate.is_set():
                # The batch cannot go before a compute slot is free: wait for that, then
                # take what arrived meanwhile (no polling while it computes).
                await gate.wait()
                more = await intake.read(limit - items, None, background=self.drain)
            else:
                remaining = policy.window_s - waited
                more = await intake.read_within(limit - items, remaining, background=self.drain)
                if not more and remaining < SHORT_WAIT_S and gate.is_set():
                    # Under a millisecond left and nothing came: the batch goes now rather
                    # than reading again and again until the window's end.
                    more = intake.take_reclaimed()
                    if not more:
                        return batch, rest, BatchClose("window", first)
            more += intake.take_reclaimed()
            pending = batch + rest + more
            if not more and self.drain and gate.is_set():
                return batch, rest, BatchClose("window", first)

    async def top_up(self, held: list[PendingRequest]) -> list[PendingRequest]:
        """Requests that wait in the streams of which this worker holds less than a batch
        (about a batch from each): what it holds stays within about two batches per stream,
        so the model's other instances get the rest."""
        per_stream: dict[str, int] = {}
        items = 1
        for request in held:
            per_stream[request.stream] = per_stream.get(request.stream, 0) + 1
            items = max(items, request.items)
        return await self.intake.top_up(max(1, self.limit // items), per_stream)

    def look_again(
        self, batch: list[PendingRequest], carry: list[PendingRequest], computing: bool
    ) -> bool:
        """Whether a batch formed while the last one computed is chosen again from what
        arrived meanwhile: a background batch, always; with deadline order, a batch that
        waited for the compute slot, while this worker holds less than a batch more (the
        rest stays in the stream, for the model's other instances)."""
        if self.stopping.is_set():
            return False
        if batch[0].level == self.background_level:
            return True
        return computing and self.deadline_order and len(carry) < self.limit

    async def serve(self, execute: Execute, gate: ComputeGate) -> None:
        """Form batches and start each on ``execute`` once ``gate`` has a free slot, until
        stopped (or, draining, until nothing is left)."""
        carry: list[PendingRequest] = []
        running: set[asyncio.Task[None]] = set()
        while True:
            batch, carry, close = await self.gather(carry, gate)
            if batch:
                computing = not gate.is_set()
                await gate.wait()
                if self.look_again(batch, carry, computing):
                    # Formed while the last batch computed: online requests that arrived
                    # meanwhile go first, or by their deadlines.
                    arrived = await self.intake.read_online(self.limit)
                    if arrived:
                        carry = arrived + batch + carry
                        continue
                elif computing and self.fair_share is not None:
                    # Formed while the last batch computed: a tenant whose requests arrived
                    # meanwhile takes its turn in this batch, not after it.
                    arrived = await self.top_up([*batch, *carry])
                    if arrived:
                        carry = arrived + batch + carry
                        continue
                gate.clear()
                if self.fair_share is not None:
                    self.fair_share.charge(batch)
                close.waited_ns = int((self.clock() - close.opened) * 1e9)
                task = asyncio.create_task(execute(batch, close, gate))
                running.add(task)
                task.add_done_callback(running.discard)
                # The batch starts before the next read goes out: one that computes on
                # the event loop sends its answers first, instead of after a read that
                # has nothing to wait for (a lone request at a low rate waited for it).
                await asyncio.sleep(0)
            elif self.stopping.is_set() or (self.drain and not running and not carry):
                break
        if running:
            await asyncio.gather(*running)


class DynamicBatcher(Batcher):
    """Triton's dynamic batching: any requests of one shape go together, by priority level,
    then arrival or (adaptive batching without ``preserve_ordering``) deadline."""

    def __init__(
        self, intake: Intake, policy: BatchPolicy, *, deadline_order: bool, **kw: Any
    ) -> None:
        super().__init__(intake, policy, **kw)
        self.deadline_order = deadline_order


class SequenceBatcher(Batcher):
    """A sequence model's batches: arrival order, one request of each sequence at most."""

    def admission(self) -> Callable[[PendingRequest], bool]:
        sequences: set[Any] = set()

        def admits(request: PendingRequest) -> bool:
            # One request of a sequence per batch: the next needs this one's state. (A
            # sequence is its tenant's: :attr:`sluice.core.sequences.SequenceRef.key`.)
            sequence = (request.message.tenant, request.message.parameters.get("sequence_id"))
            if sequence in sequences:
                return False
            sequences.add(sequence)
            return True

        return admits
