"""One worker per sequence slot, whichever hosts run workers for it.

A sequence model's slot stream must have exactly one reader, or its sequences' requests
would be computed out of order. Every ``sluice up`` starts a worker per slot, so with
several worker hosts there are several candidates per slot: the one that holds the slot's
lease (a Redis key with a time to live, renewed with the heartbeat) serves it, the others
stand by and take over when it lapses, going on from the sequences' checkpoints. A host
that dies or is cut off is replaced after the lease's lifetime.

Fencing, so that a holder cut off from Redis never acts after its lease lapsed:

- it reads requests only while its lease is valid by its own clock for longer than the
  read may block (validity is counted from *before* the renewal was sent, so it ends
  before Redis lets the key expire); every entry it holds was therefore read before a
  successor could take the slot, and the successor claims them on taking over;
- its checkpoints and acknowledgements are written in a transaction that WATCHes the
  lease key and first checks the holder: after a takeover they are refused.

A lease whose holder died on this host (same host id, its process gone) is taken at once
instead of after the lifetime: a worker restarted by ``sluice up`` goes on immediately.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field

from redis.asyncio import Redis
from redis.asyncio.client import Pipeline

log = logging.getLogger(__name__)

_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
_REPLACE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
  return 1
end
return 0
"""

_MARGIN_S = 0.25
"""Kept off the lease's validity: Redis and this process measure its lifetime apart."""


class SlotLost(RuntimeError):
    """Another worker took this worker's slot."""


@dataclass
class SlotLease:
    redis: Redis
    key: str
    holder: str
    """``<host id> <pid> <worker id>``: what the key holds while this worker serves."""
    ttl_s: float
    valid_until: float = 0.0
    """Monotonic time until which no other worker can hold the slot."""
    lost: bool = False
    _scripts: dict[str, object] = field(default_factory=dict)

    @classmethod
    def for_worker(
        cls, redis: Redis, key: str, host: str, worker_id: str, ttl_s: float
    ) -> SlotLease:
        return cls(redis, key, f"{host} {os.getpid()} {worker_id}", ttl_s)

    @property
    def held(self) -> bool:
        return not self.lost and time.monotonic() < self.valid_until

    async def acquire(self) -> bool:
        """Take the slot if it is free, or if its holder died on this host."""
        sent = time.monotonic()
        if await self.redis.set(self.key, self.holder, nx=True, px=self._ttl_ms()):
            self.valid_until = sent + self.ttl_s - _MARGIN_S
            return True
        current = await self.redis.get(self.key)
        if current is None or not _dead_here(_text(current), self.holder.split(" ", 1)[0]):
            return False
        if await self._run(_REPLACE, _text(current), self.holder, self._ttl_ms()):
            log.info("took over slot %s from a dead process on this host", self.key)
            self.valid_until = sent + self.ttl_s - _MARGIN_S
            return True
        return False

    async def renew(self) -> bool:
        """Extend the lease; False (and ``lost``) when another worker holds it now."""
        if self.lost:
            return False
        sent = time.monotonic()
        if await self._run(_RENEW, self.holder, self._ttl_ms()):
            self.valid_until = sent + self.ttl_s - _MARGIN_S
            return True
        self.lost = True
        log.error("slot %s was taken over by another worker", self.key)
        return False

    async def hold_for(self, seconds: float) -> bool:
        """Whether the lease stays valid ``seconds`` from now, renewing it if needed."""
        if self.lost:
            return False
        if time.monotonic() + seconds < self.valid_until:
            return True
        return await self.renew() and time.monotonic() + seconds < self.valid_until

    async def release(self) -> None:
        if not self.lost:
            await self._run(_RELEASE, self.holder)

    async def fence(self, pipe: Pipeline) -> None:
        """Start ``pipe``'s transaction only while this worker holds the slot: WATCH the
        lease and check its holder (SlotLost otherwise); EXEC then fails if it changes."""
        await pipe.watch(self.key)
        current = await pipe.get(self.key)
        if current is None or _text(current) != self.holder:
            self.lost = True
            raise SlotLost(f"slot {self.key} is no longer this worker's")
        pipe.multi()  # type: ignore[no-untyped-call]

    def _ttl_ms(self) -> int:
        return max(1, int(self.ttl_s * 1000))

    async def _run(self, source: str, *args: object) -> int:
        script = self._scripts.get(source)
        if script is None:
            script = self._scripts[source] = self.redis.register_script(source)
        return int(await script(keys=[self.key], args=list(args)))  # type: ignore[operator]


def _text(value: bytes | str) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def _dead_here(holder: str, host: str) -> bool:
    """Whether ``holder`` names a process of this host that no longer runs."""
    parts = holder.split(" ", 2)
    if len(parts) != 3 or parts[0] != host or not parts[1].isdigit():
        return False
    try:
        os.kill(int(parts[1]), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False
