"""Who leads among several controllers: a Redis lease with a fencing token.

A controller leads while it holds ``Keys.controller_lease`` (its id, set NX with an
expiry). Each acquisition also bumps ``Keys.controller_fencing`` in the same script, so
every leadership has its own, ever larger token. Writes that apply a decision go through
:func:`apply_fenced`: one script that checks the caller still holds the lease with the
current token and only then writes, so a leader that was paused (SIGSTOP, a long GC, a
partition) and wakes after another took over cannot apply anything.

Locally a leader counts itself lost once its last successful renewal was *sent* more than
``ttl - margin`` ago by the monotonic clock: the lease in Redis lives at least ``ttl``
from that moment, and nothing depends on clocks agreeing across hosts.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from redis import Redis

from sluice.core.keys import Keys

_ACQUIRE = """
local holder = redis.call('GET', KEYS[1])
if holder == false or holder == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return {redis.call('INCR', KEYS[2]), ARGV[1], tonumber(ARGV[2])}
end
return {0, holder, redis.call('PTTL', KEYS[1])}
"""
"""KEYS: lease, fencing; ARGV: holder, ttl ms -> {token or 0, holder, ms left}. Taking
back one's own lease (after a local timeout) gives a new token as well."""

_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] and redis.call('GET', KEYS[2]) == ARGV[2] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[3])
end
return 0
"""
"""KEYS: lease, fencing; ARGV: holder, token, ttl ms -> 1 if renewed."""

_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] and redis.call('GET', KEYS[2]) == ARGV[2] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""
"""KEYS: lease, fencing; ARGV: holder, token -> 1 if released."""

_APPLY = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] or redis.call('GET', KEYS[2]) ~= ARGV[2] then
  return 0
end
local at = 3
for i = 3, #KEYS do
  local count = tonumber(ARGV[at + 1])
  redis.call(ARGV[at], KEYS[i], unpack(ARGV, at + 2, at + 1 + count))
  at = at + 2 + count
end
return 1
"""
"""KEYS: lease, fencing, then one key per write; ARGV: holder, token, then per write its
command, its argument count and its arguments -> 1 if applied."""

Arg = str | int | float | bytes


class Write(NamedTuple):
    """One Redis command of a decision, e.g. ``Write("HSET", key, ("field", "value"))``."""

    command: str
    key: str
    args: tuple[Arg, ...] = ()


def apply_fenced(
    redis: Redis, keys: Keys, holder: str, token: int, writes: Sequence[Write]
) -> bool:
    """Run ``writes`` in one script if ``holder`` still holds the lease with fencing token
    ``token``; False (nothing written) otherwise. A write that Redis rejects raises, and
    the writes before it stay applied, as in any Redis script: check arguments first."""
    argv: list[Arg] = [holder, token]
    for write in writes:
        argv += [write.command, len(write.args), *write.args]
    script_keys = [keys.controller_lease, keys.controller_fencing, *(w.key for w in writes)]
    return bool(redis.register_script(_APPLY)(keys=script_keys, args=argv))


@dataclass(frozen=True, slots=True)
class Claim:
    """The outcome of an attempt to lead."""

    holder: str
    """Who holds the lease now (this controller's id when the attempt succeeded)."""
    token: int | None
    """This controller's fencing token when it now leads, else None."""
    expires_in_s: float
    """How long the lease lives unless renewed (-1 if it has no expiry)."""


class Lease:
    """One controller's side of the lease: acquire, renew, release, and fenced writes."""

    def __init__(
        self,
        redis: Redis,
        keys: Keys,
        holder: str,
        *,
        ttl_s: float = 3.0,
        margin_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.margin_s = ttl_s / 6 if margin_s is None else margin_s
        if not 0 <= self.margin_s < ttl_s:
            raise ValueError(f"the safety margin ({self.margin_s} s) must be below the ttl")
        self.redis = redis
        self.keys = keys
        self.holder = holder
        self.ttl_s = ttl_s
        self._clock = clock
        self._token: int | None = None
        self._valid_until = 0.0
        self._keys = [keys.controller_lease, keys.controller_fencing]
        self._acquire = redis.register_script(_ACQUIRE)
        self._renew = redis.register_script(_RENEW)
        self._release = redis.register_script(_RELEASE)

    @property
    def _ttl_ms(self) -> int:
        return max(1, round(self.ttl_s * 1000))

    @property
    def token(self) -> int | None:
        """The fencing token while this controller counts itself the leader."""
        return self._token if self.is_leader else None

    @property
    def is_leader(self) -> bool:
        """True while the lease is surely still ours: acquired or renewed (by the request's
        send time) less than ``ttl - margin`` ago, and no renewal or write was refused."""
        return self._token is not None and self._clock() < self._valid_until

    def acquire(self) -> Claim:
        """Take the lease if nobody holds it (or we still do, from before a local
        timeout): a new fencing token each time."""
        sent_at = self._clock()
        token, holder, ttl_ms = self._acquire(keys=self._keys, args=[self.holder, self._ttl_ms])
        holder_id = holder.decode() if isinstance(holder, bytes) else str(holder)
        if token:
            self._token = int(token)
            self._valid_until = sent_at + self.ttl_s - self.margin_s
            return Claim(holder_id, self._token, self.ttl_s)
        self._token = None
        return Claim(holder_id, None, int(ttl_ms) / 1000 if ttl_ms >= 0 else -1.0)

    def renew(self) -> bool:
        """Extend the lease if we still hold it with our token. A refusal makes
        :attr:`is_leader` false at once; a Redis error propagates, and leadership then
        lapses by itself when no renewal succeeds in time."""
        token = self.token
        if token is None:
            self.lost()
            return False
        sent_at = self._clock()
        if self._renew(keys=self._keys, args=[self.holder, token, self._ttl_ms]):
            self._valid_until = sent_at + self.ttl_s - self.margin_s
            return True
        self.lost()
        return False

    def release(self) -> None:
        """Give the lease up (clean shutdown) so that a standby takes over at once; only
        deletes it if it is still ours."""
        token, self._token = self._token, None
        if token is not None:
            self._release(keys=self._keys, args=[self.holder, token])

    def lost(self) -> None:
        """Forget the leadership (a refusal said another controller leads)."""
        self._token = None

    def apply(self, writes: Sequence[Write]) -> bool:
        """Apply a decision fenced by our token; False (and no longer leader) when we do
        not lead or Redis says another controller took over."""
        token = self.token
        if token is None:
            self.lost()
            return False
        if apply_fenced(self.redis, self.keys, self.holder, token, writes):
            return True
        self.lost()
        return False
