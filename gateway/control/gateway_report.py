"""What each gateway process tells the others through Redis, every catalog refresh.

Gauges that belong to a process (requests in flight, its Redis round-trip time, the client
shared memory of its host) go to a hash of its own that expires a few seconds after its last
report, so a scrape of any gateway sums the live ones and a dead process leaves no stale
series (the limited tenants' requests and bytes held, which the other processes add to
theirs, and their demand, by which the processes divide a rate, are among them). The hash
also says which catalog revision the process's view holds, which an executor that unloads
a model waits for (:mod:`sluice.core.catalog_applied`). Counters (admission refusals,
deadline misses at the gateway, the tenants' requests and refusals) are added to the
shared statistics hashes, where they survive the process.
"""

from __future__ import annotations

import logging
from collections import Counter

from redis.exceptions import RedisError

from sluice.core.catalog_applied import APPLIED_REVISION, REPORT_TTL_S, revision_number
from sluice.core.clock import CLOCK
from sluice.core.keys import base_stream
from sluice.core.observability import statistics as st
from sluice.gateway.state import GatewayState
from sluice.gateway.tenants.metrics import give_back_tenant_counts, take_tenant_counts
from sluice.gateway.tenants.sync import demand_field, in_flight_field, queued_bytes_field

log = logging.getLogger(__name__)

BODY_BUDGET_REJECTS = "body_budget.rejects"
"""Field of the gateway counters: requests refused by SLUICE_MAX_BUFFERED_BODY_BYTES."""

TORCHSERVE_RESPONSES = "torchserve.requests_"
"""Fields of the gateway counters: the answers of TorchServe's ports by class,
``torchserve.requests_2XX`` and so on (:mod:`sluice.gateway.torchserve.ports`)."""

IN_FLIGHT, ROUND_TRIP_US, CLIENT_SHM_BYTES = "in_flight", "redis_rtt_us", "client_shm_bytes"
CLIENT_SHM_HOST = "client_shm_host"
"""The host the client regions of a report are of (every gateway process of a host
reports the same ones: see :meth:`RegionRegistry.host_tag`)."""


async def report(state: GatewayState, gateway_id: str, round_trip_s: float) -> None:
    """Publish this process's gauges and hand its counters over; counters that could not
    be written are kept for the next report."""
    keys = state.keys
    rejected = state.admission.take_rejected()
    tenant_counts = take_tenant_counts(state)
    dispatcher = state.dispatcher
    expired, dispatcher.expired = dispatcher.expired, Counter()
    cancelled, dispatcher.cancelled = dispatcher.cancelled, Counter()
    body_rejects, state.bodies.refused = state.bodies.refused, 0
    responses, state.torchserve_responses = state.torchserve_responses, Counter()
    now = CLOCK.now()
    try:
        gauges = {
            IN_FLIGHT: state.admission.in_flight,
            ROUND_TRIP_US: int(round_trip_s * 1e6),
            CLIENT_SHM_BYTES: state.regions.system_bytes(),
            CLIENT_SHM_HOST: state.regions.host_tag(),
        }
        applied = revision_number(state.view.revision) if state.view.loaded else None
        if applied is not None:  # (an executor waits for it: :mod:`sluice.core.catalog_applied`)
            gauges[APPLIED_REVISION] = applied
        for tenant, (in_flight, queued_bytes) in state.quota.own_usage().items():
            gauges[in_flight_field(tenant)] = in_flight
            gauges[queued_bytes_field(tenant)] = queued_bytes
        for tenant, per_s in state.quota.measure_demand().items():
            gauges[demand_field(tenant)] = round(per_s * 1000)
        counts: list[tuple[str, str, int]] = []
        for (model, version, reason), count in rejected.items():
            stats = keys.stats(model, version)
            counts.append((stats, st.failure_field("REJECTED"), count))
            counts.append((stats, st.reject_field(reason), count))
        streams = _stream_owners(state) if expired or cancelled else {}
        for stream, count in expired.items():
            owner = _owner(streams, stream)
            if owner is not None:
                counts.append((keys.stats(*owner), st.deadline_miss_field("gateway"), count))
        for stream, count in cancelled.items():
            owner = _owner(streams, stream)
            if owner is not None:  # Triton's failure reason for a cancelled request
                counts.append((keys.stats(*owner), st.failure_field("CANCELED"), count))
        if body_rejects:
            counts.append((keys.gateway_counters, BODY_BUDGET_REJECTS, body_rejects))
        counts += [(keys.gateway_counters, name, count) for name, count in tenant_counts.items()]
        counts += [
            (keys.gateway_counters, TORCHSERVE_RESPONSES + kind, count)
            for kind, count in responses.items()
        ]
        await state.control.publish_report(gateway_id, gauges, REPORT_TTL_S, now, counts)
    except BaseException:
        state.admission.rejected.update(rejected)
        dispatcher.expired.update(expired)
        dispatcher.cancelled.update(cancelled)
        state.bodies.refused += body_rejects
        state.torchserve_responses.update(responses)
        give_back_tenant_counts(state, tenant_counts)
        raise


async def withdraw(state: GatewayState, gateway_id: str) -> None:
    """This process stops: its last counters are handed over and it leaves the live
    processes now. Until its report expired, the others would still divide the tenants'
    rates by it (a gateway restarted, or one that could not take its port, halved them)."""
    try:
        await report(state, gateway_id, 0.0)
        await state.control.withdraw_report(gateway_id)
    except RedisError as exc:  # (its report expires in REPORT_TTL_S all the same)
        log.info("could not withdraw this gateway's report: %s", exc)


def _owner(owners: dict[str, tuple[str, int]], stream: str) -> tuple[str, int] | None:
    """The model version of a request stream, a tenant's own streams included
    (``<level stream>:t:<tenant>``)."""
    return owners.get(stream) or owners.get(base_stream(stream))


def _stream_owners(state: GatewayState) -> dict[str, tuple[str, int]]:
    """Request stream name -> (model, version), for the streams in the catalog."""
    owners: dict[str, tuple[str, int]] = {}
    for entry in state.view.models.values():
        for version in entry.versions:
            for stream in state.view.streams(entry, version):
                owners[stream] = (entry.name, version)
    return owners
