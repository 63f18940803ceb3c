"""Admission control: refuse work before it is queued, at constant cost.

Two bounds. Per model version, the queue depth (the larger of this gateway's
own requests and the entries in its streams, read from Redis in the background, while that
reading is fresh: :attr:`Admission.fresh_s`) may not pass
the model's ``max_queue_size``: 503 with Triton's text (core ``PolicyQueue::Enqueue``:
"[request id: <id>] Exceeds maximum queue size"). Per gateway process, the requests held
at once may not pass ``max_in_flight``: 503. Both answers carry Retry-After.

A full queue is shared between tenants by weight (:mod:`sluice.core.tenant_limits`), so one
flooding tenant does not lock the others out: while the queue is full, a tenant that holds
(in this process) fewer requests of the model than its weighted share of ``max_queue_size``
(its weight over the sum of the weights of the tenants holding requests of the model here)
is still admitted, up to twice ``max_queue_size``; the others get Triton's 503. A tenant
alone (the one tenant of a deployment without keys, say) is refused as soon as the queue
is full, as Triton does.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from sluice.core.errors import Overloaded, ServerBusy
from sluice.core.tenants import ANONYMOUS


def _weight_one(tenant: str) -> float:
    return 1.0


@dataclass
class Admission:
    max_in_flight: int
    in_flight: int = 0
    per_model: dict[tuple[str, int], int] = field(default_factory=dict)
    observed_depth: dict[tuple[str, int], int] = field(default_factory=dict)
    """Queue depth per model version as last read from Redis (all gateways' requests)."""
    observed_at: float = float("-inf")
    """When it was read (monotonic seconds)."""
    fresh_s: float = 1.0
    """How long a reading counts (two active refreshes): an older one comes from a refresh
    that slowed down because nothing arrived, which the arrival now being judged wakes
    again; until it reads the queue anew, only this process's own requests count."""
    rejected: Counter[tuple[str, int, str]] = field(default_factory=Counter)
    """Requests refused per model version and reason (``ADMISSION_REJECT_REASONS``)
    since the last hand-over to the metrics."""
    arrived: int = 0
    """Requests that asked to be admitted, ever (the catalog refresh slows down while it
    does not move)."""
    arrival: asyncio.Event = field(default_factory=asyncio.Event)
    """Set by each arrival; an idle catalog refresh clears it and sleeps until it is set
    again (or its idle pace is due)."""
    weight: Callable[[str], float] = _weight_one
    """A tenant's weight (the tenant limits in force set it)."""
    per_tenant: dict[tuple[str, int], dict[str, int]] = field(default_factory=dict)
    """Requests held by this process per model version and tenant (tenants holding none
    are left out)."""
    tenant_admitted: Counter[str] = field(default_factory=Counter)
    """Requests admitted per tenant since the last hand-over to the metrics."""
    tenant_queue_full: Counter[str] = field(default_factory=Counter)
    """Requests refused per tenant because the model's queue was full, likewise."""
    tenant_cancelled: Counter[str] = field(default_factory=Counter)
    """Admitted requests per tenant whose callers went away before their answer, likewise."""

    @contextmanager
    def admit(
        self,
        model: str,
        version: int,
        max_queue_size: int,
        request_id: str = "",
        tenant: str = ANONYMOUS,
    ) -> Iterator[None]:
        key = (model, version)
        self.arrived += 1
        if not self.arrival.is_set():
            self.arrival.set()
        held = self.check_room(model, version, max_queue_size, request_id, tenant)
        self.in_flight += 1
        self.per_model[key] = self.per_model.get(key, 0) + 1
        held[tenant] = held.get(tenant, 0) + 1
        self.tenant_admitted[tenant] += 1
        try:
            yield
        except asyncio.CancelledError:  # its caller went away (sluice.core.cancellation)
            self.tenant_cancelled[tenant] += 1
            raise
        finally:
            self.in_flight -= 1
            self.per_model[key] -= 1
            left = held[tenant] - 1
            if left:
                held[tenant] = left
            else:
                del held[tenant]

    def check_room(
        self,
        model: str,
        version: int,
        max_queue_size: int,
        request_id: str = "",
        tenant: str = ANONYMOUS,
    ) -> dict[str, int]:
        """Refuse a request this process or the model's queue has no room for (counted);
        else the model version's requests held here per tenant. Also called before a large
        body is read, so that a refusal does not read it first."""
        key = (model, version)
        if self.in_flight >= self.max_in_flight:
            self.rejected[(model, version, "in_flight")] += 1
            raise ServerBusy(
                f"the gateway holds {self.in_flight} requests, its limit; retry later", 1
            )
        held = self.per_tenant.get(key)
        if held is None:
            held = self.per_tenant[key] = {}
        if max_queue_size:
            observed = self.observed_depth.get(key, 0)
            if observed and time.monotonic() - self.observed_at > self.fresh_s:
                observed = 0  # (a drained queue must not refuse the first request after)
            depth = max(self.per_model.get(key, 0), observed)
            if depth >= max_queue_size and not self._under_share(
                held, tenant, depth, max_queue_size
            ):
                self.rejected[(model, version, "queue_full")] += 1
                self.tenant_queue_full[tenant] += 1
                raise Overloaded(
                    f"[request id: {request_id or '<id_unknown>'}] Exceeds maximum queue size; "
                    f"model '{model}' version {version} has {depth} queued requests, "
                    f"its max_queue_size is {max_queue_size}; retry later",
                    1,
                )
        return held

    def _under_share(
        self, held: dict[str, int], tenant: str, depth: int, max_queue_size: int
    ) -> bool:
        """Whether ``tenant`` may still join a full queue: other tenants hold requests of
        the model here, it holds fewer than its weighted share of ``max_queue_size``, and
        the queue is below twice that size."""
        if depth >= 2 * max_queue_size or not held or held.keys() == {tenant}:
            return False
        weight = self.weight
        total = sum(weight(other) for other in held)
        mine = weight(tenant)
        if tenant not in held:
            total += mine
        return held.get(tenant, 0) < max_queue_size * mine / total

    def observe(self, depths: dict[tuple[str, int], int]) -> None:
        self.observed_depth = depths
        self.observed_at = time.monotonic()

    def take_rejected(self) -> Counter[tuple[str, int, str]]:
        """The refusals counted since the last call (then forgotten here)."""
        taken, self.rejected = self.rejected, Counter()
        return taken

    def take_cancelled(self) -> Counter[str]:
        """Cancellations per tenant since the last call (then forgotten here)."""
        taken, self.tenant_cancelled = self.tenant_cancelled, Counter()
        return taken

    def take_tenant_counts(self) -> tuple[Counter[str], Counter[str]]:
        """Admitted and queue-full refusals per tenant since the last call (then forgotten
        here)."""
        taken = self.tenant_admitted, self.tenant_queue_full
        self.tenant_admitted, self.tenant_queue_full = Counter(), Counter()
        return taken
