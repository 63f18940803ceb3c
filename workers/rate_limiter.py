"""Triton's rate limiter in the worker: with ``--rate-limit=execution_count``, an instance
whose group lists ``rate_limiter`` resources holds them while it computes a batch, and waits
while the instances holding them leave too few (:mod:`sluice.core.rate_limit` says how many
copies each resource has).

The resources live in Redis, one hash per resource and device (or per global resource), so
that every worker of every host counts the same copies. In it, each instance that uses the
resource registers what it needs (``r:<worker>``; the most registered is the count of a
resource given none) and each batch computing holds its share (``h:<hold>``). Every field
carries its expiry on Redis's clock: a worker killed while it holds resources gives them back
when its hold runs out (:data:`HOLD_S`, renewed while the batch computes), and one that is
gone stops counting among the registrations after :data:`REGISTRATION_S`. One script takes
all of an instance's resources at once or none, so two instances never wait on each other
holding half.

A waiting instance tries again after a short sleep that grows to :data:`MAX_WAIT_S`, scaled
by its group's ``priority`` (priority 2 tries half as often as priority 1), which gives it
about the share of chances Triton's priority gives; Triton orders the waiting instances
exactly instead (see docs/differences.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from redis.asyncio import Redis
from redis.exceptions import RedisError

from sluice.core.config import InstanceGroup, ModelConfig, RateLimiterResource
from sluice.core.errors import InvalidConfig
from sluice.core.keys import Keys
from sluice.core.placement import Placement
from sluice.core.rate_limit import EXECUTION_COUNT, ResourceCounts, parse_resource_counts
from sluice.core.settings import RateLimitSettings

HOLD_S = 10.0
"""How long a hold lasts unless renewed (renewed every third of it while computing)."""
REGISTRATION_S = 60.0
"""How long an instance's registration lasts unless renewed (every third of it)."""
FIRST_WAIT_S = 0.002
MAX_WAIT_S = 0.05

_ACQUIRE = """
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
local hold, worker, released = ARGV[1], ARGV[2], ARGV[5]
local hold_until, registered_until = now + tonumber(ARGV[3]), now + tonumber(ARGV[4])
local fits = true
for i = 1, #KEYS do
  if released ~= '' then redis.call('HDEL', KEYS[i], 'h:' .. released) end
  local need, given = tonumber(ARGV[4 + 2 * i]), tonumber(ARGV[5 + 2 * i])
  redis.call('HSET', KEYS[i], 'r:' .. worker, need .. ':' .. registered_until)
  local fields = redis.call('HGETALL', KEYS[i])
  local used, most = 0, 0
  for j = 1, #fields, 2 do
    local value = fields[j + 1]
    local colon = string.find(value, ':', 1, true)
    local count = tonumber(string.sub(value, 1, colon - 1))
    if tonumber(string.sub(value, colon + 1)) < now then
      redis.call('HDEL', KEYS[i], fields[j])
    elseif string.sub(fields[j], 1, 2) == 'h:' then
      used = used + count
    elseif count > most then
      most = count
    end
  end
  local copies = most
  if given >= 0 then copies = given end
  if used + need > copies then fits = false end
end
if not fits then return 0 end
for i = 1, #KEYS do
  redis.call('HSET', KEYS[i], 'h:' .. hold, ARGV[4 + 2 * i] .. ':' .. hold_until)
end
return 1
"""
"""KEYS: the resources' hashes. ARGV: the hold's id, the worker's id, the hold's and the
registration's time to live (ms), the id of this worker's last hold (released: gone if its
release has not arrived yet; '' for none), then each resource's need and given count (-1:
none). -> 1 held, 0 not (too few free)."""

_RENEW = """
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
for i = 1, #KEYS do
  local value = redis.call('HGET', KEYS[i], ARGV[1])
  if value then
    local colon = string.find(value, ':', 1, true)
    redis.call('HSET', KEYS[i], ARGV[1], string.sub(value, 1, colon) .. (now + tonumber(ARGV[2])))
  end
end
return 1
"""
"""KEYS: the resources' hashes. ARGV: the field (``h:<hold>`` or ``r:<worker>``), its new
time to live (ms)."""


@dataclass(frozen=True, slots=True)
class _Need:
    key: str
    count: int
    given: int | None


class RateLimiter:
    """The resources one instance holds while it computes a batch."""

    def __init__(self, redis: Redis, worker_id: str, needs: Sequence[_Need], priority: int) -> None:
        self._redis = redis
        self._worker = worker_id
        self._needs = tuple(needs)
        self._keys = [need.key for need in self._needs]
        self._priority = max(1, priority)
        self._acquire = redis.register_script(_ACQUIRE)
        self._renew = redis.register_script(_RENEW)
        self._released = ""
        """The last hold given back (its release may still be on its way)."""
        self._releasing: set[asyncio.Task[None]] = set()

    @contextlib.asynccontextmanager
    async def holding(self) -> AsyncIterator[None]:
        """Hold this instance's resources for the block (waiting for them first)."""
        hold = uuid.uuid4().hex
        await self._take(hold)
        renewing = asyncio.create_task(self._keep(f"h:{hold}", HOLD_S))
        try:
            yield
        finally:
            renewing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await renewing
            # Given back off the answer's path; this worker's next take removes it too,
            # should its release not have arrived by then.
            self._released = hold
            release = asyncio.create_task(self._release(hold))
            self._releasing.add(release)
            release.add_done_callback(self._releasing.discard)

    async def settled(self) -> None:
        """Wait for the holds given back to be gone from Redis (at a worker's stop)."""
        if self._releasing:
            await asyncio.gather(*self._releasing, return_exceptions=True)

    async def keep_registered(self) -> None:
        """Renew this instance's registration until cancelled (a background task)."""
        await self._keep(f"r:{self._worker}", REGISTRATION_S)

    async def _take(self, hold: str) -> None:
        args: list[str | int] = [
            hold,
            self._worker,
            int(HOLD_S * 1000),
            int(REGISTRATION_S * 1000),
            self._released,
        ]
        for need in self._needs:
            args += [need.count, -1 if need.given is None else need.given]
        wait = FIRST_WAIT_S
        while True:
            try:
                if await self._acquire(keys=self._keys, args=args):
                    return
            except RedisError:
                pass  # (Redis out of reach: tried again, as the queue's reads are)
            await asyncio.sleep(wait * self._priority)
            wait = min(MAX_WAIT_S, wait * 2)

    async def _keep(self, field: str, ttl_s: float) -> None:
        while True:
            await asyncio.sleep(ttl_s / 3)
            with contextlib.suppress(RedisError):
                await self._renew(keys=self._keys, args=[field, int(ttl_s * 1000)])

    async def _release(self, hold: str) -> None:
        with contextlib.suppress(RedisError):
            async with self._redis.pipeline(transaction=False) as pipe:
                for key in self._keys:
                    pipe.hdel(key, f"h:{hold}")
                await pipe.execute()


def group_of(groups: Sequence[InstanceGroup], slot: int) -> InstanceGroup | None:
    """The instance group of the ``slot``-th instance (in the groups' order; an instance
    added by autoscaling beyond them counts in the last)."""
    passed = 0
    for group in groups:
        passed += group.count
        if slot < passed:
            return group
    return groups[-1] if groups else None


def rate_limiter_for(
    redis: Redis,
    keys: Keys,
    settings: RateLimitSettings,
    config: ModelConfig,
    slot: int,
    placement: Placement,
    host: str,
    worker_id: str,
) -> RateLimiter | None:
    """The instance's limiter; None when rate limiting is off or its group lists no
    resources. An instance that needs more of a resource than the count given for it could
    never execute: InvalidConfig (its load fails with the reason)."""
    if settings.rate_limit != EXECUTION_COUNT:
        return None
    group = group_of(config.instance_groups, slot)
    if group is None or group.rate_limiter is None or not group.rate_limiter.resources:
        return None
    counts = parse_resource_counts(settings.rate_limit_resources)
    device = placement.gpu if placement.gpu is not None else 0
    needs = [
        _need(keys, counts, resource, host, device) for resource in group.rate_limiter.resources
    ]
    for resource, need in zip(group.rate_limiter.resources, needs, strict=True):
        if need.given is not None and need.count > need.given:
            where = "" if resource.global_ else f" on device {device}"
            raise InvalidConfig(
                f"instance group '{group.name}' needs {need.count} of rate limiter resource "
                f"'{resource.name}'{where}, but --rate-limit-resource gives only {need.given}"
            )
    return RateLimiter(redis, worker_id, needs, group.rate_limiter.priority)


def _need(
    keys: Keys, counts: ResourceCounts, resource: RateLimiterResource, host: str, device: int
) -> _Need:
    if resource.global_:
        key = keys.rate_limit_resource(resource.name)
        return _Need(key, resource.count, counts.given(resource.name, None))
    key = keys.rate_limit_resource(resource.name, host, device)
    return _Need(key, resource.count, counts.given(resource.name, device))
