"""Weighted fair share between tenants within a priority level (sluice.workers.fair_share),
alone and inside the batching loop against an in-memory intake."""

from __future__ import annotations

import asyncio
import itertools
import timeit

from sluice.core.wire import RequestMessage
from sluice.workers.adaptive import BatchPolicy
from sluice.workers.batcher import DynamicBatcher, SequenceBatcher
from sluice.workers.fair_share import FairShare, parse_weights
from sluice.workers.replies import BatchClose
from sluice.workers.slots import ComputeGate
from sluice.workers.tensors import PendingRequest
from tests.unit.workers.test_batcher import BACKGROUND, Clock, MemoryIntake, free_gate

_ids = itertools.count(1)


def request(tenant: str, level: int = 0, *, items: int = 1, deadline_ns: int = 0) -> PendingRequest:
    number = next(_ids)
    message = RequestMessage(f"{tenant}{number}", "", [], ["y"], deadline_ns=deadline_ns)
    message.tenant = tenant
    entry = f"{number}-0".encode()
    stream = f"stream-of-{tenant}"
    return PendingRequest(entry, message, memoryview(b""), items, (("x", (4,)),), stream, level)


def tenants(requests: list[PendingRequest]) -> str:
    return "".join(r.message.tenant for r in requests)


def batcher(
    intake: MemoryIntake,
    share: FairShare | None,
    *,
    limit: int = 4,
    deadline_order: bool = False,
    drain: bool = False,
) -> DynamicBatcher:
    return DynamicBatcher(
        intake,
        BatchPolicy(0.001, False),
        deadline_order=deadline_order,
        max_batch_size=limit,
        background_level=BACKGROUND,
        stopping=asyncio.Event(),
        drain=drain,
        clock=intake.clock,
        fair_share=share,
    )


# -- ordering ----------------------------------------------------------------------------


def test_two_tenants_of_equal_weight_take_turns() -> None:
    share = FairShare()
    held = [request("a") for _ in range(6)] + [request("b") for _ in range(3)]
    share.interleave(held)
    assert tenants(held) == "ababababa"[:6] + "aaa"


def test_one_tenant_keeps_the_batchers_order() -> None:
    share = FairShare({"a": 5.0})
    held = [request("a", level) for level in (0, 1, 0, BACKGROUND, 1)]
    before = list(held)
    share.interleave(held)
    assert held == before


def test_levels_go_first_whatever_the_tenants() -> None:
    chosen = batcher(MemoryIntake(Clock()), FairShare(), limit=3).select(
        [request("a", 1), request("b", BACKGROUND), request("a", 0), request("b", 1)]
    )
    assert [r.level for r in chosen.batch] == [0, 1, 1]
    assert [r.level for r in chosen.rest] == [BACKGROUND]


def test_deadline_order_is_kept_within_a_tenant() -> None:
    b = batcher(MemoryIntake(Clock()), FairShare(), limit=8, deadline_order=True)
    late, soon, none = request("a", deadline_ns=300), request("a", deadline_ns=100), request("a")
    other = request("b", deadline_ns=200)
    chosen = b.select([late, none, other, soon])
    order = [r.message.request_key for r in chosen.batch]
    assert [k for k in order if k.startswith("a")] == [
        soon.message.request_key,
        late.message.request_key,
        none.message.request_key,
    ]
    assert tenants(chosen.batch)[:2] in ("ab", "ba")


def test_arrival_order_is_kept_within_a_tenant() -> None:
    share = FairShare()
    a = [request("a") for _ in range(4)]
    b = [request("b") for _ in range(4)]
    held = [*a, *b]
    share.interleave(held)
    assert [r for r in held if r.message.tenant == "a"] == a
    assert [r for r in held if r.message.tenant == "b"] == b


def test_weights_split_what_is_served() -> None:
    share = FairShare({"a": 3.0, "b": 1.0})
    served = {"a": 0, "b": 0}
    for _ in range(100):  # both always have more waiting than a batch
        held = [request("a") for _ in range(4)] + [request("b") for _ in range(4)]
        share.interleave(held)
        batch = held[:4]
        share.charge(batch)
        for r in batch:
            served[r.message.tenant] += r.items
    assert served["a"] == 300 and served["b"] == 100


def test_a_tenant_that_idled_earns_no_credit() -> None:
    share = FairShare()
    for _ in range(50):  # a alone for a while
        held = [request("a") for _ in range(4)]
        share.interleave(held)
        share.charge(held[:2])
    held = [request("a") for _ in range(4)] + [request("b") for _ in range(4)]
    share.interleave(held)
    assert tenants(held[:4]) in ("abab", "baba")  # b takes turns, it does not take over


def test_the_default_weight_weighs_tenants_not_named() -> None:
    share = FairShare(parse_weights({b"*": b"2", b"b": b"1", b"bad": b"x", b"zero": b"0"}))
    assert share.weight("a") == 2.0
    assert share.weight("b") == 1.0
    assert share.weight("bad") == 2.0
    assert share.weight("zero") == 2.0
    assert FairShare().weight("anyone") == 1.0


def test_a_sequence_batcher_keeps_arrival_order() -> None:
    intake = MemoryIntake(Clock())
    seq = SequenceBatcher(
        intake,
        BatchPolicy(0.001, False),
        max_batch_size=8,
        background_level=BACKGROUND,
        stopping=asyncio.Event(),
        clock=intake.clock,
    )
    held = [request("a"), request("a"), request("b")]
    for number, one in enumerate(held, 1):
        one.message.parameters["sequence_id"] = number
    chosen = seq.select(list(held))  # (three sequences: no turns by tenant)
    assert tenants(chosen.batch) == "aab"
    held = [request("a"), request("a"), request("b")]
    for one in held:
        one.message.parameters["sequence_id"] = 7  # (a's sequence 7 twice, b's once)
    chosen = seq.select(list(held))
    assert tenants(chosen.batch) == "ab" and tenants(chosen.rest) == "a"


def test_ordering_costs_a_few_microseconds_per_request() -> None:
    share = FairShare()
    held = [request("a") for _ in range(32)] + [request("b") for _ in range(32)]

    def once() -> None:
        pending = list(held)
        share.interleave(pending)
        share.charge(pending[:16])

    per_request_s = min(timeit.repeat(once, number=50, repeat=3)) / 50 / len(held)
    assert per_request_s < 50e-6  # (a 10x margin over the 5 us the design allows)


# -- in the batching loop ------------------------------------------------------------------


class TenantIntake(MemoryIntake):
    """Reads as the stream intake does: up to ``count`` from each tenant's stream."""

    def _take(self, count: int, online_only: bool) -> list[PendingRequest]:
        taken: list[tuple[float, PendingRequest]] = []
        per_tenant: dict[str, int] = {}
        for item in self._due(online_only):
            tenant = item[1].message.tenant
            if per_tenant.get(tenant, 0) < max(1, count):
                per_tenant[tenant] = per_tenant.get(tenant, 0) + 1
                taken.append(item)
        for item in taken:
            self.scheduled.remove(item)
        return [r for _, r in taken]

    async def top_up(self, count: int, held: dict[str, int]) -> list[PendingRequest]:
        await asyncio.sleep(0)
        taken: list[tuple[float, PendingRequest]] = []
        per_tenant: dict[str, int] = {}
        for item in self._due(True):
            tenant = item[1].message.tenant
            if held.get(item[1].stream, 0) >= count:
                continue
            if per_tenant.get(tenant, 0) < count:
                per_tenant[tenant] = per_tenant.get(tenant, 0) + 1
                taken.append(item)
        for item in taken:
            self.scheduled.remove(item)
        return [r for _, r in taken]


async def served_batches(share: FairShare | None) -> list[str]:
    """Tenant a floods (40 requests), then tenant b sends 3: the batches in compute order."""
    intake = TenantIntake(Clock())
    intake.arrive(*[request("a") for _ in range(40)])
    intake.arrive(*[request("b") for _ in range(3)])  # (after them)
    b = batcher(intake, share, limit=4, drain=True)
    ran: list[str] = []

    async def execute(batch: list[PendingRequest], close: BatchClose, gate: ComputeGate) -> None:
        ran.append(tenants(batch))
        gate.set()

    await b.serve(execute, free_gate())
    return ran


async def test_a_flooding_tenant_does_not_delay_another_tenants_requests() -> None:
    ran = await served_batches(FairShare())
    assert "".join(ran).count("b") == 3 and "".join(ran).count("a") == 40
    last_b = max(i for i, t in enumerate(ran) if "b" in t)
    assert last_b <= 3  # within the first batches, not after the 10 batches of a's flood


async def test_weights_split_a_saturated_worker_three_to_one() -> None:
    intake = TenantIntake(Clock())
    intake.arrive(*[request("a") for _ in range(400)], *[request("b") for _ in range(400)])
    b = batcher(intake, FairShare({"a": 3.0, "b": 1.0}), limit=4, drain=True)
    ran: list[str] = []

    async def execute(batch: list[PendingRequest], close: BatchClose, gate: ComputeGate) -> None:
        ran.append(tenants(batch))
        gate.set()

    await b.serve(execute, free_gate())
    first = "".join(ran)[:400]  # while both still wait
    assert abs(first.count("a") / first.count("b") - 3.0) < 0.3
