"""A tenant's request stream made known before the gateway's first entry in it.

Each tenant has its own stream in each priority level of a model version
(:meth:`sluice.core.keys.Keys.request_stream` with a tenant), so that the workers can share the
level between tenants (:mod:`sluice.workers.fair_share`). Workers read the streams listed in
the version's set (:meth:`~sluice.core.keys.Keys.tenant_streams`); before a gateway process
appends to a tenant's stream for the first time, one script in the model's slot creates
the stream's consumer group, adds the stream to the set and, if it was new there, puts a
wake-up entry in the level's base stream (:data:`sluice.core.queue_streams.REGISTER`): the
workers' blocking read ends at once and they read the set again, so a new tenant's first
request does not wait out their idle read.

What the process made known is cached (:class:`sluice.core.queue_streams.TenantStreams`:
every request of a known tenant costs nothing), forgotten every thirty seconds and whenever
Redis failed or restarted, so a Redis that lost its data is healed by the next request.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from redis.exceptions import RedisError

from sluice.core.errors import QUEUE_UNREACHABLE, Unavailable
from sluice.core.keys import base_stream
from sluice.core.queue_streams import REGISTER

if TYPE_CHECKING:
    from sluice.gateway.state import GatewayState


async def make_known(state: GatewayState, model: str, version: int, stream: str) -> None:
    """:meth:`TenantStreams.ensure` with the gateway's script and Redis server; Redis out
    of reach is the client's 503, as for the append."""
    if base_stream(stream) != stream:
        try:
            await state.tenant_streams.ensure(
                state.control.script(REGISTER),
                state.keys,
                model,
                version,
                stream,
                state.redis_run_id,
            )
        except RedisError:
            raise Unavailable(QUEUE_UNREACHABLE) from None
