"""Each tenant's limits, enforced in this gateway process without a Redis round trip.

- ``rate`` (and ``burst``): a token bucket per tenant. With several gateway processes (on
  one host or several) the rate is divided between them by where the tenant's requests
  arrive: each process measures its tenant's demand (requests that asked for a token,
  admitted or not, per second) and reports it at every refresh, and reads the others'.
  While the demands together stay within the rate, each process gets its own demand plus
  an equal part of what is left; beyond it, the rate in proportion to the demands (each
  request then has the same chance, wherever it arrives). A process's bucket holds
  ``max(1, burst * its share)`` tokens. So a tenant whose requests all reach one process
  (one gRPC channel, one kept-alive connection) gets its whole rate there, one refresh
  after its traffic moved; before any demand is known the processes share equally.
- ``max_in_flight`` and ``max_queued_bytes``: this process's own count plus the counts the
  other processes reported at their last refresh (every ``catalog_refresh_s``, see
  :mod:`sluice.gateway.control.gateway_report`). A burst that reaches several processes within one
  refresh may pass the limit by what each of them admitted meanwhile.

A refusal is :class:`QuotaExceeded` (429, gRPC RESOURCE_EXHAUSTED) naming the tenant and
the limit (``rate``, ``in_flight``, ``queued_bytes``), with Retry-After: the time until the
next token for ``rate``, 1 s for the others. A tenant with no limit costs one dict lookup.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from types import TracebackType

from sluice.core.errors import PayloadTooLarge, QuotaExceeded
from sluice.core.tenant_limits import TenantLimit, TenantLimits
from sluice.gateway.inference.request import InputTensor

_NOTHING: AbstractContextManager[None] = contextlib.nullcontext()


class TokenBucket:
    """Up to ``burst`` tokens, refilled at ``rate`` per second; a request takes one."""

    __slots__ = ("burst", "rate", "stamp", "tokens")

    def __init__(self, rate: float, burst: float, now: float) -> None:
        self.rate, self.burst = rate, burst
        self.tokens, self.stamp = burst, now

    def take(self, now: float) -> float:
        """0 when a token was taken, else the seconds until there is one."""
        tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if tokens >= 1.0:
            self.tokens = tokens - 1.0
            return 0.0
        self.tokens = tokens
        return (1.0 - tokens) / self.rate

    def wait(self, now: float) -> float:
        """The seconds until a token is there (0: now), taking none."""
        tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        return 0.0 if tokens >= 1.0 else (1.0 - tokens) / self.rate

    def resize(self, rate: float, burst: float, now: float) -> None:
        """New rate and size; the tokens held so far stay (up to the new size)."""
        self.tokens = min(burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp, self.rate, self.burst = now, rate, burst


@dataclass(eq=False, slots=True)
class TenantUsage:
    """One limited tenant: its limit, its bucket, and what it holds."""

    tenant: str
    limit: TenantLimit
    bucket: TokenBucket | None = None
    in_flight: int = 0
    """Its requests held by this process."""
    queued_bytes: int = 0
    """Their bytes."""
    peer_in_flight: int = 0
    """Its requests held by the other gateway processes, as they last reported."""
    peer_queued_bytes: int = 0
    asked: int = 0
    """Requests that asked for a token here since the demand was last measured."""
    demand: float | None = None
    """Those per second, smoothed (None until first measured)."""
    peer_demand: float = 0.0
    """The other processes' demand, as they last reported."""


@dataclass(frozen=True, slots=True)
class PeerUsage:
    """What the other gateway processes reported of one tenant, summed."""

    in_flight: int = 0
    queued_bytes: int = 0
    demand: float = 0.0
    """Requests per second that asked them for a token."""


class _Held:
    """A request counted in its tenant's usage until it is answered."""

    __slots__ = ("nbytes", "usage")

    def __init__(self, usage: TenantUsage, nbytes: int) -> None:
        self.usage, self.nbytes = usage, nbytes

    def __enter__(self) -> None:
        return None

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.usage.in_flight -= 1
        self.usage.queued_bytes -= self.nbytes


@dataclass(eq=False)
class TenantQuota:
    """The limits in force in this process and each limited tenant's usage."""

    tenants: Collection[str] = ()
    """The tenants that exist (of the configured keys; ``anonymous`` without keys)."""
    clock: Callable[[], float] = time.monotonic
    limits: TenantLimits = field(default_factory=TenantLimits)
    processes: int = 1
    """Live gateway processes of the deployment (the rate's slack is shared among them)."""
    usage: dict[str, TenantUsage] = field(default_factory=dict)
    """The tenants with a limit (the others are not here)."""
    rejected: Counter[tuple[str, str]] = field(default_factory=Counter)
    """Refusals per (tenant, limit) since the last hand-over to the metrics."""
    jobs_admitted: Counter[str] = field(default_factory=Counter)
    """Asynchronous jobs that passed the tenant's rate, likewise."""
    measured_at: float | None = None
    """When the demand was last measured (:meth:`measure_demand`)."""

    def __post_init__(self) -> None:
        self.apply(self.limits)

    def apply(self, limits: TenantLimits) -> None:
        """Put ``limits`` in force; the tenants' usage and tokens carry over."""
        now = self.clock()
        usage: dict[str, TenantUsage] = {}
        for tenant in self.tenants:
            limit = limits.of(tenant)
            if not limit.limited:
                continue
            current = self.usage.get(tenant) or TenantUsage(tenant, limit)
            current.limit = limit
            current.bucket = self._bucket(current, current.bucket, now)
            usage[tenant] = current
        self.limits, self.usage = limits, usage

    def set_processes(self, processes: int) -> None:
        """The live gateway processes changed: each bucket takes its new share."""
        processes = max(1, processes)
        if processes == self.processes:
            return
        self.processes = processes
        self._resize_all()

    def _resize_all(self) -> None:
        now = self.clock()
        for usage in self.usage.values():
            usage.bucket = self._bucket(usage, usage.bucket, now)

    def _bucket(
        self, usage: TenantUsage, bucket: TokenBucket | None, now: float
    ) -> TokenBucket | None:
        limit = usage.limit
        if limit.rate is None or limit.burst is None:
            return None
        rate = self._rate_share(limit.rate, usage.demand or 0.0, usage.peer_demand)
        burst = max(1.0, limit.burst * rate / limit.rate)
        if bucket is None:
            return TokenBucket(rate, burst, now)
        bucket.resize(rate, burst, now)
        return bucket

    def _rate_share(self, rate: float, own: float, peers: float) -> float:
        """This process's part of ``rate``, by the demands (module docstring)."""
        total = own + peers
        if total <= rate:
            return own + (rate - total) / self.processes
        # (never nothing: a process whose demand is not known yet admits a trickle)
        return max(rate * own / total, rate / (100 * self.processes))

    def measure_demand(self) -> dict[str, float]:
        """Each rate-limited tenant's requests per second that asked this process for a
        token since the last call (smoothed over calls), for the report the other
        processes read; the buckets take their new shares."""
        now = self.clock()
        elapsed = now - self.measured_at if self.measured_at is not None else 0.0
        self.measured_at = now
        measured: dict[str, float] = {}
        for tenant, usage in self.usage.items():
            if usage.bucket is None:
                continue
            if elapsed > 0:
                latest = usage.asked / elapsed
                previous = usage.demand
                usage.demand = latest if previous is None else (previous + latest) / 2
            usage.asked = 0
            measured[tenant] = usage.demand or 0.0
        self._resize_all()
        return measured

    def hold(self, tenant: str, inputs: Iterable[InputTensor]) -> AbstractContextManager[None]:
        """Count one request of ``tenant`` until the block ends, or refuse it."""
        usage = self.usage.get(tenant)
        if usage is None:
            return _NOTHING
        limit = usage.limit
        self._check_in_flight(usage)
        nbytes = 0
        if limit.max_queued_bytes is not None:
            nbytes = sum(len(tensor.data) for tensor in inputs)
            held = usage.queued_bytes + usage.peer_queued_bytes
            if nbytes > limit.max_queued_bytes:
                self.rejected[(tenant, "queued_bytes")] += 1
                raise PayloadTooLarge(
                    f"the request's inputs hold {nbytes} bytes, more than tenant "
                    f"'{tenant}' may have queued (its queued_bytes limit, "
                    f"max_queued_bytes={limit.max_queued_bytes})"
                )
            if held + nbytes > limit.max_queued_bytes:
                self._refuse(usage, "queued_bytes", f"max_queued_bytes={limit.max_queued_bytes}", 1)
        self._take_token(usage)
        usage.in_flight += 1
        usage.queued_bytes += nbytes
        return _Held(usage, nbytes)

    def check_early(self, tenant: str) -> None:
        """Refuse a request of ``tenant`` that :meth:`hold` would refuse for its requests in
        flight or its rate, before its body is read (taking no token: :meth:`hold` does)."""
        usage = self.usage.get(tenant)
        if usage is None:
            return
        self._check_in_flight(usage)
        bucket = usage.bucket
        if bucket is not None:
            wait = bucket.wait(self.clock())
            if wait:
                usage.asked += 1  # (admitted, it asks again in hold)
            self._refuse_rate(usage, wait)

    def check_rate(self, tenant: str) -> None:
        """Take a token of ``tenant`` for a request that is not held here (a job), or
        refuse it."""
        usage = self.usage.get(tenant)
        if usage is not None:
            self._take_token(usage)
        self.jobs_admitted[tenant] += 1

    def _take_token(self, usage: TenantUsage) -> None:
        bucket = usage.bucket
        if bucket is None:
            return
        usage.asked += 1
        self._refuse_rate(usage, bucket.take(self.clock()))

    def _check_in_flight(self, usage: TenantUsage) -> None:
        limit = usage.limit.max_in_flight
        if limit is not None and usage.in_flight + usage.peer_in_flight >= limit:
            self._refuse(usage, "in_flight", f"max_in_flight={limit}", 1)

    def _refuse_rate(self, usage: TenantUsage, wait: float) -> None:
        """Refuse when a token is ``wait`` seconds away (0: there is one)."""
        if wait:
            limit = usage.limit
            self._refuse(
                usage,
                "rate",
                f"rate={_number(limit.rate or 0)}/s, burst={_number(limit.burst or 1)}",
                max(1, math.ceil(wait)),
            )

    def _refuse(self, usage: TenantUsage, name: str, detail: str, retry_after_s: int) -> None:
        self.rejected[(usage.tenant, name)] += 1
        raise QuotaExceeded(
            f"tenant '{usage.tenant}' is over its {name} limit ({detail}); retry later",
            retry_after_s,
        )

    def own_usage(self) -> dict[str, tuple[int, int]]:
        """Tenant -> (requests held, their bytes) in this process, for the limited tenants
        (the report the other processes read)."""
        return {t: (u.in_flight, u.queued_bytes) for t, u in self.usage.items()}

    def observe_peers(self, peers: Mapping[str, PeerUsage]) -> None:
        """What the other live gateway processes hold and are asked for per tenant, summed;
        the buckets take their new shares."""
        nothing = PeerUsage()
        for tenant, usage in self.usage.items():
            peer = peers.get(tenant, nothing)
            usage.peer_in_flight, usage.peer_queued_bytes = peer.in_flight, peer.queued_bytes
            usage.peer_demand = peer.demand
        self._resize_all()

    def take_counts(self) -> tuple[Counter[tuple[str, str]], Counter[str]]:
        """Refusals per (tenant, limit) and jobs admitted per tenant since the last call
        (then forgotten here)."""
        taken = self.rejected, self.jobs_admitted
        self.rejected, self.jobs_admitted = Counter(), Counter()
        return taken


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:g}"
