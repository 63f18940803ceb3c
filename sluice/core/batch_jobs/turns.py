"""A tenant's batch jobs take turns: at most ``SLUICE_TENANT_MAX_RUNNING_BATCHES`` of them
run at once (planning or running, each with its window of shard tasks in the batch
queue); a job submitted or resumed beyond it waits, status ``queued``, in line, and starts
as one of the tenant's running jobs ends. So one tenant's 10,000 jobs neither fill Redis
with shard tasks nor take most of the batch workers' turns from a tenant with one job.

Bookkeeping, all in the namespace's hash slot (one script at a time):
``Keys.tenant_running_batches(tenant)`` (the jobs holding a turn, id -> when they got it),
``Keys.tenant_queued_batches(tenant)`` (the line, id -> its number) and
``Keys.batch_turn_tenants`` (the tenants with either, for the periodic round). A job's
record is in a slot of its own, so a job moves in two steps, each atomic: it gets a turn
(:data:`ADMIT`, or :data:`LEAVE` as the one before it leaves), then its record goes from
``queued`` to planning or running (:data:`START`) and whoever made that move sends its plan
task. Whoever sees a job end (a batch worker, or the gateway that cancels or deletes it)
gives its turn to the next in line and starts it; the batch workers' periodic round
(:meth:`Turns.sweep`) does what a process killed between two steps left undone: it gives
back the turns of jobs that ended, starts those given a turn and still ``queued``, and
sends again a plan task not run within :data:`~sluice.core.batch_jobs.batches.RESUME_QUEUED_S`.

A plan task sent here always resumes (``resume=True``): it plans a job never planned, and
resumes one that was. ``resume_queued`` is set as it is sent, so that the client's resumes
meanwhile queue nothing more (:data:`~sluice.core.batch_jobs.batches.RESUME`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import cast

from redis import Redis

from sluice.core.batch_jobs import batches as b
from sluice.core.clock import CLOCK
from sluice.core.keys import Keys

log = logging.getLogger(__name__)

SendPlan = Callable[[str], None]
"""Queue the plan task (``resume=True``) of a batch job."""

ADMIT = """
-- KEYS: the tenant's running batches, its line, the tenants with turns
-- ARGV: batch id, the tenant's max running batches, tenant, now (unix s)
if redis.call('ZSCORE', KEYS[1], ARGV[1]) then return 0 end
local rank = redis.call('ZRANK', KEYS[2], ARGV[1])
if rank then return rank + 1 end
redis.call('SADD', KEYS[3], ARGV[3])
if redis.call('ZCARD', KEYS[2]) == 0 and redis.call('ZCARD', KEYS[1]) < tonumber(ARGV[2]) then
  redis.call('ZADD', KEYS[1], ARGV[4], ARGV[1])
  return 0
end
local last = redis.call('ZRANGE', KEYS[2], -1, -1, 'WITHSCORES')
local number = 1
if #last > 0 then number = tonumber(last[2]) + 1 end
redis.call('ZADD', KEYS[2], number, ARGV[1])
return redis.call('ZCARD', KEYS[2])
"""
"""-> 0: the job holds a turn (it had one, or one was free and nobody waits); else its place
in the tenant's line (1: next), at the end unless it was in line already. Idempotent."""

LEAVE = """
-- KEYS: the tenant's running batches, its line, the tenants with turns
-- ARGV: tenant, the tenant's max running batches (0: give no turns), now, batch id...
for i = 4, #ARGV do
  redis.call('ZREM', KEYS[1], ARGV[i])
  redis.call('ZREM', KEYS[2], ARGV[i])
end
local given = {}
local room = tonumber(ARGV[2]) - redis.call('ZCARD', KEYS[1])
if room > 0 then
  for _, id in ipairs(redis.call('ZRANGE', KEYS[2], 0, room - 1)) do
    redis.call('ZREM', KEYS[2], id)
    redis.call('ZADD', KEYS[1], ARGV[3], id)
    table.insert(given, id)
  end
end
if redis.call('ZCARD', KEYS[1]) == 0 and redis.call('ZCARD', KEYS[2]) == 0 then
  redis.call('SREM', KEYS[3], ARGV[1])
end
return given
"""
"""-> the jobs given a turn now, first in line first (the caller starts them): the jobs
named leave (their turn, or their place in line), and the first in line take the turns
free."""

START = """
-- KEYS: batch hash; ARGV: now (unix s), how long a queued plan task holds (s)
local status = redis.call('HGET', KEYS[1], 'status')
if status ~= 'queued' then return {status or '', 0} end
local shards = redis.call('HGET', KEYS[1], 'shards')
local next = 'planning'
if shards and shards ~= '' then next = 'running' end
redis.call('HSET', KEYS[1], 'status', next)
local queued = tonumber(redis.call('HGET', KEYS[1], 'resume_queued') or '') or 0
if queued > 0 and tonumber(ARGV[1]) - queued < tonumber(ARGV[2]) then
  return {status, 0}
end
redis.call('HSET', KEYS[1], 'resume_queued', ARGV[1])
return {status, 1}
"""
"""-> {the job's status before (``''``: no such job), 1 when the caller sends its plan task}.
A ``queued`` job starts: ``planning``, or ``running`` when it was planned before (a resumed
job); any other is left as it is. A plan task sent less than ARGV[2] s ago and not run yet
(``resume_queued``) takes the job as it is when it runs: no other is sent."""

RESEND = """
-- KEYS: batch hash; ARGV: now (unix s), how long a queued plan task holds (s)
local status = redis.call('HGET', KEYS[1], 'status')
if status ~= 'planning' and status ~= 'running' then return 0 end
local queued = tonumber(redis.call('HGET', KEYS[1], 'resume_queued') or '') or 0
if queued == 0 or tonumber(ARGV[1]) - queued < tonumber(ARGV[2]) then return 0 end
redis.call('HSET', KEYS[1], 'resume_queued', ARGV[1])
return 1
"""
"""-> 1: the plan task sent for this job ARGV[2] s ago or more was never run (lost, or
never sent: its sender died or the broker refused it): the caller sends it again."""

WITHDRAW = """
-- KEYS: batch hash; ARGV: finished (unix s)
if redis.call('HGET', KEYS[1], 'status') ~= 'queued' then return 0 end
redis.call('HSET', KEYS[1], 'status', 'cancelled', 'finished', ARGV[1])
return 1
"""
"""-> 1: a job waiting in line is cancelled (to be deleted); 0: it is no longer waiting
(it started meanwhile): nothing is changed."""

_NEVER = "1"
"""``resume_queued`` of a plan task that was not sent: long ago, so that the next periodic
round sends it."""


def tenant_keys(keys: Keys, tenant: str) -> list[str]:
    """KEYS of :data:`ADMIT` and :data:`LEAVE`."""
    return [
        keys.tenant_running_batches(tenant),
        keys.tenant_queued_batches(tenant),
        keys.batch_turn_tenants,
    ]


def forget(redis: Redis, keys: Keys, tenant: str, batch_id: str) -> None:
    """Take a job out of its tenant's turns and line, giving no turn to another (a job
    removed; the periodic round gives the turn it held)."""
    redis.eval(LEAVE, 3, *tenant_keys(keys, tenant), tenant, 0, 0, batch_id)


class Turns:
    """A tenant's turns, as a batch worker (or a gateway, on a thread) moves them:
    ``send_plan`` queues a plan task; without it, turns are given back but none is given
    (the periodic round of a batch worker gives them)."""

    def __init__(self, redis: Redis, keys: Keys, limit: int, send_plan: SendPlan | None) -> None:
        self.redis, self.keys, self.limit, self.send_plan = redis, keys, limit, send_plan

    def admit(self, tenant: str, batch_id: str) -> int:
        """:data:`ADMIT`: 0 when the job holds a turn, else its place in line."""
        now = f"{CLOCK.now():.3f}"
        return int(
            cast(
                int,
                self.redis.eval(
                    ADMIT, 3, *tenant_keys(self.keys, tenant), batch_id, self.limit, tenant, now
                ),
            )
        )

    def leave(self, tenant: str, *batch_ids: str) -> None:
        """The jobs named ended (or were removed): their turns go to the next in line, who
        start."""
        self.start(tenant, self._leave(tenant, batch_ids))

    def _leave(self, tenant: str, batch_ids: Sequence[str]) -> list[str]:
        limit = self.limit if self.send_plan is not None else 0
        given = self.redis.eval(
            LEAVE,
            3,
            *tenant_keys(self.keys, tenant),
            tenant,
            limit,
            f"{CLOCK.now():.3f}",
            *batch_ids,
        )
        return [raw.decode() for raw in cast(list[bytes], given)]

    def start(self, tenant: str, batch_ids: Sequence[str]) -> None:
        """Start the jobs given a turn (:data:`START`, then their plan tasks). One that is
        no longer queued and no longer runs (cancelled as it got its turn, removed) gives
        its turn on to the next in line."""
        pending = list(batch_ids)
        while pending:
            CLOCK.sync_blocking(self.redis)  # (resume_queued is read by gateways elsewhere)
            gone: list[str] = []
            for batch_id in pending:
                before, send = cast(
                    list[bytes | int],
                    self.redis.eval(
                        START,
                        1,
                        self.keys.batch(batch_id),
                        f"{CLOCK.now():.3f}",
                        b.RESUME_QUEUED_S,
                    ),
                )
                status = cast(bytes, before).decode()
                if status == b.QUEUED:
                    log.info("batch %s: its tenant's turn; it starts", batch_id)
                    if send:
                        self._send(batch_id)
                elif status not in (b.PLANNING, b.RUNNING):
                    gone.append(batch_id)
            pending = self._leave(tenant, gone) if gone else []

    def _send(self, batch_id: str) -> None:
        """Queue the plan task; when the broker refuses it, the next periodic round sends it
        again (:data:`RESEND`)."""
        assert self.send_plan is not None
        try:
            self.send_plan(batch_id)
        except Exception as exc:
            log.warning("batch %s: its plan task was not sent (sent again soon): %s", batch_id, exc)
            self.redis.hset(self.keys.batch(batch_id), b.F_RESUME_QUEUED, _NEVER)

    def sweep(self) -> None:
        """The periodic round: for every tenant with turns, the turns of jobs that ended
        (their ender killed before it gave them on) go to the next in line, jobs given a
        turn that are still ``queued`` start, and a plan task never run is sent again."""
        CLOCK.sync_blocking(self.redis)
        now = CLOCK.now()
        for raw in cast(set[bytes], self.redis.smembers(self.keys.batch_turn_tenants)):
            tenant = raw.decode()
            holding = cast(
                list[bytes], self.redis.zrange(self.keys.tenant_running_batches(tenant), 0, -1)
            )
            gone: list[str] = []
            waiting: list[str] = []
            for raw_id in holding:
                batch_id = raw_id.decode()
                status = cast(bytes | None, self.redis.hget(self.keys.batch(batch_id), b.F_STATUS))
                if status is None or status.decode() in b.FINISHED:
                    gone.append(batch_id)
                elif status.decode() == b.QUEUED:
                    waiting.append(batch_id)
                elif self.send_plan is not None and self.redis.eval(
                    RESEND, 1, self.keys.batch(batch_id), f"{now:.3f}", b.RESUME_QUEUED_S
                ):
                    log.warning("batch %s: its plan task was never run; sent again", batch_id)
                    self._send(batch_id)
            if self.send_plan is not None:
                self.start(tenant, waiting)
            if gone:
                log.info("batch jobs of tenant %s ended: %d turn(s) given on", tenant, len(gone))
            self.leave(tenant, *gone)  # (with none gone: gives the turns free, if any)
