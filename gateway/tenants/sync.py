"""What the tenant limits need from Redis, every catalog refresh: the file's changes put in
force, their weights written for the workers, and what the other gateway processes hold.

Each process reports its limited tenants' requests in flight, queued bytes and demand in
its gateway report (:mod:`sluice.gateway.control.gateway_report`, fields :func:`in_flight_field`,
:func:`queued_bytes_field` and :func:`demand_field`); here it reads the live processes'
reports: their counts add to this process's own, and their number and demands divide the
tenants' rates (:mod:`sluice.gateway.tenants.quota`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any, cast

from redis.asyncio import Redis

from sluice.core.clock import CLOCK
from sluice.core.keys import Keys
from sluice.core.tenant_limits import TenantLimits
from sluice.gateway.state import GatewayState
from sluice.gateway.tenants.quota import PeerUsage

_IN_FLIGHT, _QUEUED_BYTES = "tenant_in_flight:", "tenant_queued_bytes:"
_DEMAND = "tenant_demand_milli:"


def in_flight_field(tenant: str) -> str:
    """Field of a gateway report: the tenant's requests held by that process."""
    return _IN_FLIGHT + tenant


def queued_bytes_field(tenant: str) -> str:
    """Field of a gateway report: their bytes."""
    return _QUEUED_BYTES + tenant


def demand_field(tenant: str) -> str:
    """Field of a gateway report: the tenant's requests per 1,000 s that asked that process
    for a token (admitted or refused)."""
    return _DEMAND + tenant


def put_in_force(state: GatewayState, limits: TenantLimits) -> None:
    """Enforce ``limits`` from the next request on, and share queues by their weights."""
    state.quota.apply(limits)
    state.admission.weight = limits.weight
    state.limits_source.weights_written = False


async def follow_tenant_limits(state: GatewayState, gateway_id: str) -> None:
    """Reload the limits file if it changed, write the weights when they are not in Redis
    yet, and read the other processes' counts when some tenant is limited."""
    source = state.limits_source
    if source.due():  # (a file of thousands of tenants takes a second to parse)
        limits = await asyncio.to_thread(source.changed_limits)
        if limits is not None:
            put_in_force(state, limits)
    if not source.weights_written:
        await write_weights(state.redis, state.keys, state.quota.limits)
        source.weights_written = True
    if state.quota.usage:
        await _read_peers(state, gateway_id)


async def write_weights(redis: Redis, keys: Keys, limits: TenantLimits) -> None:
    """Replace the weights hash by those of ``limits``, at once for its readers."""
    async with redis.pipeline(transaction=True) as pipe:
        pipe.delete(keys.tenant_weights)
        pipe.hset(keys.tenant_weights, mapping=limits.weights())  # type: ignore[arg-type]
        await pipe.execute()


async def _read_peers(state: GatewayState, gateway_id: str) -> None:
    keys, quota = state.keys, state.quota
    members = cast(
        list[bytes | str], await state.redis.zrangebyscore(keys.gateways, CLOCK.now(), "+inf")
    )
    live = [_text(member) for member in members]
    # (this host's own processes at least, before each of them has reported)
    quota.set_processes(max(len(live), state.settings.gateway_processes))
    others = [member for member in live if member != gateway_id]
    if not others:
        quota.observe_peers({})
        return
    async with state.redis.pipeline(transaction=False) as pipe:
        for member in others:
            pipe.hgetall(keys.gateway_report(member))
        reports = await pipe.execute(raise_on_error=False)
    quota.observe_peers(peer_usage(quota.usage, reports))


def peer_usage(tenants: Iterable[str], reports: Iterable[Any]) -> dict[str, PeerUsage]:
    """Tenant -> what the reports say of it, summed."""
    wanted = list(tenants)
    sums = {tenant: [0, 0, 0] for tenant in wanted}
    for report in reports:
        if not isinstance(report, dict):
            continue
        for tenant in wanted:
            total = sums[tenant]
            total[0] += _int(report.get(in_flight_field(tenant).encode()))
            total[1] += _int(report.get(queued_bytes_field(tenant).encode()))
            total[2] += _int(report.get(demand_field(tenant).encode()))
    return {
        tenant: PeerUsage(total[0], total[1], total[2] / 1000) for tenant, total in sums.items()
    }


def _int(value: Any) -> int:
    """A report's count; 0 for what is none (a malformed or out-of-range value)."""
    try:
        number = int(value) if value is not None else 0
    except (TypeError, ValueError):
        return 0
    return number if 0 <= number < 1 << 63 else 0


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
