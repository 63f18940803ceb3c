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

What the process made known is cached (every request of a known tenant costs nothing),
forgotten every :data:`FORGET_S` and whenever Redis failed or restarted, so a Redis that lost
its data is healed by the next request.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from redis.commands.core import AsyncScript
from redis.exceptions import RedisError

from sluice.core.errors import QUEUE_UNREACHABLE, Unavailable
from sluice.core.keys import WORKER_GROUP, Keys, base_stream
from sluice.core.queue_streams import REGISTER, register_keys

if TYPE_CHECKING:
    from sluice.gateway.state import GatewayState

FORGET_S = 30.0
"""How long a process trusts that a tenant stream it made known is still there."""


@dataclass
class TenantStreams:
    """What one gateway process made known (stream -> when to forget it, monotonic s)."""

    known: dict[str, float] = field(default_factory=dict)
    run_id: str = ""
    """The Redis server the cache is about (another one: forgotten)."""

    async def ensure(
        self,
        script: AsyncScript,
        keys: Keys,
        model: str,
        version: int,
        stream: str,
        run_id: str = "",
    ) -> None:
        """Make ``stream`` known before the first entry of this process goes to it (a base
        stream needs nothing). Raises RedisError like the append that follows would."""
        if base_stream(stream) == stream:
            return
        now = time.monotonic()
        if run_id != self.run_id:
            self.known.clear()
            self.run_id = run_id
        until = self.known.get(stream)
        if until is not None and until > now:
            return
        try:
            await script(keys=register_keys(keys, model, version, stream), args=[WORKER_GROUP])
        except RedisError:
            self.known.clear()
            raise
        if len(self.known) > 10_000:
            self.known = {s: t for s, t in self.known.items() if t > now}
        self.known[stream] = now + FORGET_S


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
