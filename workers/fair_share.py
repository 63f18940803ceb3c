"""Weighted fair share between tenants within each priority level.

When one tenant floods a model, another tenant's requests of the same level must not wait
behind the flood. A worker orders what it holds by start-time fair queueing: each tenant of
a level has a virtual time, the items of it that were served divided by its weight; the
tenant with the smallest virtual time goes next, and its virtual time moves on by each
request it is given. A tenant that becomes active starts at the level's current virtual
time (the smallest among the tenants that wait), not where it stopped: idling earns no
credit. Within one tenant, requests keep the order the batcher gives them (arrival, or
earliest deadline first). Levels still go first, the background level last.

Only the batches that go to compute move virtual times (:meth:`FairShare.charge`). Only
the requests one worker holds are ordered; every worker of the model version does the same
with what it holds, and each holds about a batch per tenant stream at most (its reads take
a batch from each stream), so the share holds across the version's workers too.

With one tenant (a deployment without API keys) nothing changes: the order is the batcher's.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping
from typing import Any

from sluice.core.tenant_limits import WILDCARD
from sluice.workers.tensors import PendingRequest


def parse_weights(raw: Mapping[Any, Any]) -> dict[str, float]:
    """The weights of the hash (tenant -> weight); entries that are not positive numbers are
    left out (their tenant weighs as the default, or 1)."""
    weights: dict[str, float] = {}
    for name, value in raw.items():
        tenant = name.decode() if isinstance(name, bytes) else str(name)
        try:
            weight = float(value)
        except (TypeError, ValueError):
            continue
        if weight > 0 and weight != float("inf"):
            weights[tenant] = weight
    return weights


class FairShare:
    """The tenants' virtual times of one worker, per level, and their weights."""

    def __init__(self, weights: Mapping[str, float] | None = None) -> None:
        self.weights: dict[str, float] = dict(weights or {})
        """Tenant -> weight (``*``: every tenant not named; absent: 1)."""
        self._virtual: dict[tuple[int, str], float] = {}
        self._floor: dict[int, float] = {}
        """Per level: its virtual time (where a tenant that becomes active starts)."""
        self._active: dict[int, set[str]] = {}
        """Per level held by more than one tenant at the last ordering: those tenants."""

    def weight(self, tenant: str) -> float:
        weight = self.weights.get(tenant)
        if weight is None:
            weight = self.weights.get(WILDCARD, 1.0)
        return weight

    def virtual_time(self, level: int, tenant: str) -> float:
        """Where ``tenant`` stands in ``level`` (at least the level's virtual time)."""
        floor = self._floor.get(level, 0.0)
        return max(self._virtual.get((level, tenant), floor), floor)

    def interleave(self, pending: list[PendingRequest]) -> None:
        """Reorder ``pending`` (in place; sorted by level, then the order within a tenant)
        so that within each level the tenants take turns by virtual time."""
        if not pending:
            return
        first = pending[0].message.tenant
        for request in pending:
            if request.message.tenant != first:
                break
        else:
            # One tenant: the batcher's order as it is, and every tenant (the next one
            # too) starts even, at the levels' current time.
            if self._active:
                self._active = {}
                self._lift()
            return
        self._active = {}
        ordered: list[PendingRequest] = []
        start = 0
        while start < len(pending):
            level = pending[start].level
            end = start
            while end < len(pending) and pending[end].level == level:
                end += 1
            ordered += self._level_order(level, pending[start:end])
            start = end
        pending[:] = ordered

    def _level_order(self, level: int, requests: list[PendingRequest]) -> list[PendingRequest]:
        by_tenant: dict[str, list[PendingRequest]] = {}
        for request in requests:
            queue = by_tenant.get(request.message.tenant)
            if queue is None:
                by_tenant[request.message.tenant] = [request]
            else:
                queue.append(request)
        if len(by_tenant) == 1:
            return requests
        self._active[level] = set(by_tenant)
        # (virtual time, the tenant's first place in the batcher's order, tenant, next index);
        # dicts keep insertion order, so ``place`` is the order of first appearance.
        turns = [
            (self.virtual_time(level, tenant), place, tenant, 0)
            for place, tenant in enumerate(by_tenant)
        ]
        heapq.heapify(turns)
        weights = {tenant: self.weight(tenant) for tenant in by_tenant}
        ordered: list[PendingRequest] = []
        while turns:
            virtual, place, tenant, index = turns[0]
            queue = by_tenant[tenant]
            request = queue[index]
            ordered.append(request)
            if index + 1 < len(queue):
                step = request.items / weights[tenant]
                heapq.heapreplace(turns, (virtual + step, place, tenant, index + 1))
            else:
                heapq.heappop(turns)
        return ordered

    def charge(self, batch: list[PendingRequest]) -> None:
        """The batch goes to compute: its tenants' virtual times move on by its items, and
        each level's virtual time to the least of its tenants that wait. Nothing to do
        while each level holds one tenant's requests only."""
        if not self._active:
            return
        served: dict[tuple[int, str], int] = {}
        for request in batch:
            key = (request.level, request.message.tenant)
            served[key] = served.get(key, 0) + request.items
        for (level, tenant), items in served.items():
            self._virtual[(level, tenant)] = self.virtual_time(level, tenant) + items / self.weight(
                tenant
            )
        for level, tenants in self._active.items():
            floor = min(self.virtual_time(level, tenant) for tenant in tenants)
            if floor > self._floor.get(level, 0.0):
                self._floor[level] = floor
        self._lift()

    def _lift(self) -> None:
        """Forget the virtual times at or below their level's: a tenant that waits no more
        (or that shares no level now) starts at the level's time when it comes back."""
        stale = [
            key
            for key, virtual in self._virtual.items()
            if virtual <= self._floor.get(key[0], 0.0) or not self._active
        ]
        for key in stale:
            del self._virtual[key]
