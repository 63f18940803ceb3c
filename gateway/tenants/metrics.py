"""The tenants' metric families: requests admitted and refused per tenant (counters every
gateway process adds to the shared gateway counters at its report, so any process renders
the deployment's totals), the limits in force, and the limits file's failed reloads.

- ``sluice_tenant_requests_total{tenant}``: requests admitted (synchronous, streaming, jobs);
- ``sluice_tenant_rejected_total{tenant,limit}``: refused by the tenant's ``rate``,
  ``in_flight``, ``queued_bytes``, or by a full model queue (``queue_full``);
- ``sluice_tenant_cancelled_total{tenant}``: admitted requests whose callers went away
  before their answer (:mod:`sluice.core.cancellation`);
- ``sluice_tenant_limit{tenant,limit}``: the limits in force in the answering process
  (``weight``, ``rate``, ``burst``, ``in_flight``, ``queued_bytes``; tenant ``*``: the default);
- ``sluice_tenant_limits_reload_errors_total``: reloads of the limits file that failed.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from sluice.core.tenant_limits import LIMIT_NAMES, WILDCARD, TenantLimit, TenantLimits
from sluice.gateway.metrics.snapshot import Snapshot
from sluice.gateway.state import GatewayState

REQUESTS = "tenant.requests:"
"""Gateway counter field prefix: requests admitted, then the tenant."""
REJECTED = "tenant.rejected:"
"""Gateway counter field prefix: refusals, then ``<limit>:<tenant>``."""
CANCELLED = "tenant.cancelled:"
"""Gateway counter field prefix: requests whose callers went away, then the tenant."""
RELOAD_ERRORS = "tenant_limits.reload_errors"
"""Gateway counter field: failed reloads of the tenant limits file."""
QUEUE_FULL = "queue_full"


def take_tenant_counts(state: GatewayState) -> dict[str, int]:
    """The tenant counts of this process since the last call, by gateway counter field
    (then forgotten here; :func:`give_back_tenant_counts` if they could not be written)."""
    admitted, queue_full = state.admission.take_tenant_counts()
    rejected, jobs = state.quota.take_counts()
    admitted.update(jobs)
    fields = {REQUESTS + tenant: count for tenant, count in admitted.items() if count}
    for tenant, count in queue_full.items():
        fields[f"{REJECTED}{QUEUE_FULL}:{tenant}"] = count
    for (tenant, limit), count in rejected.items():
        fields[f"{REJECTED}{limit}:{tenant}"] = count
    for tenant, count in state.admission.take_cancelled().items():
        fields[CANCELLED + tenant] = count
    errors = state.limits_source.take_reload_errors()
    if errors:
        fields[RELOAD_ERRORS] = errors
    return fields


def give_back_tenant_counts(state: GatewayState, fields: dict[str, int]) -> None:
    """Keep counts that could not be written for the next report."""
    for name, count in fields.items():
        if name == RELOAD_ERRORS:
            state.limits_source.give_back_reload_errors(count)
        elif name.startswith(REQUESTS):
            state.admission.tenant_admitted[name[len(REQUESTS) :]] += count
        elif name.startswith(CANCELLED):
            state.admission.tenant_cancelled[name[len(CANCELLED) :]] += count
        elif name.startswith(REJECTED):
            limit, _, tenant = name[len(REJECTED) :].partition(":")
            if limit == QUEUE_FULL:
                state.admission.tenant_queue_full[tenant] += count
            else:
                state.quota.rejected[(tenant, limit)] += count


REFUSING_LIMITS = (*LIMIT_NAMES, QUEUE_FULL)


class _Families:
    def __init__(
        self, counters: dict[str, int], limits: TenantLimits, tenants: tuple[str, ...]
    ) -> None:
        self.counters, self.limits, self.tenants = counters, limits, tenants

    def collect(self) -> Iterator[Metric]:
        requests = CounterMetricFamily(
            "sluice_tenant_requests",
            "Requests admitted per tenant (synchronous, streaming and asynchronous jobs)",
            labels=["tenant"],
        )
        rejected = CounterMetricFamily(
            "sluice_tenant_rejected",
            "Requests refused per tenant and limit: rate, in_flight, queued_bytes (the "
            "tenant's own limits, 429) or queue_full (the model's queue, 503)",
            labels=["tenant", "limit"],
        )
        cancelled = CounterMetricFamily(
            "sluice_tenant_cancelled",
            "Admitted requests per tenant whose callers went away before their answer "
            "(a disconnected client, a cancelled gRPC call): withdrawn from the queue",
            labels=["tenant"],
        )
        # Every tenant of the deployment's keys has each series from the start (at 0), so
        # rates and alerts see a first refusal or cancellation as an increase.
        counters = dict.fromkeys((CANCELLED + tenant for tenant in self.tenants), 0)
        for tenant in self.tenants:
            counters.update(dict.fromkeys((f"{REJECTED}{x}:{tenant}" for x in REFUSING_LIMITS), 0))
        counters.update(self.counters)
        # The counters of tenants whose keys are gone stay in Redis, but not on /metrics:
        # rotated keys do not add series for good.
        tenants = frozenset(self.tenants)
        for name, count in sorted(counters.items()):
            if name.startswith(REQUESTS):
                tenant = name[len(REQUESTS) :]
                if tenant in tenants:
                    requests.add_metric([tenant], count)
            elif name.startswith(CANCELLED):
                tenant = name[len(CANCELLED) :]
                if tenant in tenants:
                    cancelled.add_metric([tenant], count)
            elif name.startswith(REJECTED):
                limit, _, tenant = name[len(REJECTED) :].partition(":")
                if tenant in tenants:
                    rejected.add_metric([tenant, limit], count)
        yield requests
        yield rejected
        yield cancelled
        limit_family = GaugeMetricFamily(
            "sluice_tenant_limit",
            "The tenant limits in force in the answering gateway process (tenant '*': "
            "every tenant not named); rate in requests/s, queued_bytes in bytes",
            labels=["tenant", "limit"],
        )
        rows: list[tuple[str, TenantLimit]] = [(WILDCARD, self.limits.default)]
        rows += sorted(self.limits.tenants.items())
        for tenant, tenant_limit in rows:
            for name, value in tenant_limit.gauges().items():
                limit_family.add_metric([tenant, name], value)
        yield limit_family
        errors = CounterMetricFamily(
            "sluice_tenant_limits_reload_errors",
            "Reloads of the tenant limits file that failed (the previous limits stayed)",
        )
        errors.add_metric([], self.counters.get(RELOAD_ERRORS, 0))
        yield errors


def render(snapshot: Snapshot, limits: TenantLimits, tenants: tuple[str, ...] = ()) -> bytes:
    """The families of ``tenants`` (those of the deployment's keys, or ``anonymous`` alone
    without keys): each has every refusal and cancellation series, at 0 until they count;
    other tenants' counters (of keys since removed) are left out."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(snapshot.gateway_counters, limits, tenants))
    return generate_latest(registry)
