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

Where the step in the record's slot comes first, the step before it in the namespace's slot
says it is coming, so that a process killed between the two leaves something the periodic
round finds:

- a gateway (a job submitted, or resumed after it ended) writes the job into its tenant's
  ``Keys.tenant_admitting_batches`` (:data:`INTEND`) before it writes the job ``queued``,
  and :data:`ADMIT` takes it out. The round admits a job found there ``queued`` (a turn, or
  its place in line), and drops an entry older than :data:`ADMITTING_GRACE_S` whose job is
  not (never written: its gateway stopped before; or not resumed after all);
- a batch worker that takes a job's plan task marks it in the record
  (:data:`PLAN_TAKEN`, in the same step that clears ``resume_queued``) and clears the mark
  once the job runs with its window filled (:data:`PLAN_DONE`). The job holds its turn all
  along, so the round sees it; one still planning or running whose mark is older than
  ``RESUME_QUEUED_S`` lost its batch worker in between (before it was planned, or between
  starting and being listed among the running jobs the reapers top up): the round sends its
  plan task again, which resumes it as it is.

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
-- KEYS: the tenant's running batches, its line, the tenants with turns, its admitting
-- ARGV: batch id, the tenant's max running batches, tenant, now (unix s)
redis.call('ZREM', KEYS[4], ARGV[1])
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
in the tenant's line (1: next), at the end unless it was in line already. Idempotent. The
job is no longer on its way in (:data:`INTEND`)."""

LEAVE = """
-- KEYS: the tenant's running batches, its line, the tenants with turns, its admitting
-- ARGV: tenant, the tenant's max running batches (0: give no turns), now, batch id...
for i = 4, #ARGV do
  redis.call('ZREM', KEYS[1], ARGV[i])
  redis.call('ZREM', KEYS[2], ARGV[i])
  redis.call('ZREM', KEYS[4], ARGV[i])
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
if redis.call('ZCARD', KEYS[1]) == 0 and redis.call('ZCARD', KEYS[2]) == 0
    and redis.call('ZCARD', KEYS[4]) == 0 then
  redis.call('SREM', KEYS[3], ARGV[1])
end
return given
"""
"""-> the jobs given a turn now, first in line first (the caller starts them): the jobs
named leave (their turn, their place in line, or their way in), and the first in line take
the turns free."""

INTEND = """
-- KEYS: the tenant's running batches, its line, the tenants with turns, its admitting
-- ARGV: batch id, tenant, now (unix s)
redis.call('ZADD', KEYS[4], ARGV[3], ARGV[1])
redis.call('SADD', KEYS[3], ARGV[2])
return 1
"""
"""A gateway is about to make the job ``queued`` (a new job, or one resumed after it
ended), then :data:`ADMIT` it: until then the periodic round finds it here."""

LAPSE = """
-- KEYS: the tenant's running batches, its line, the tenants with turns, its admitting
-- ARGV: tenant, batch id, the latest time (unix s) an entry dropped was written
local since = tonumber(redis.call('ZSCORE', KEYS[4], ARGV[2]) or '')
if not since or since > tonumber(ARGV[3]) then return 0 end
redis.call('ZREM', KEYS[4], ARGV[2])
if redis.call('ZCARD', KEYS[1]) == 0 and redis.call('ZCARD', KEYS[2]) == 0
    and redis.call('ZCARD', KEYS[4]) == 0 then
  redis.call('SREM', KEYS[3], ARGV[1])
end
return 1
"""
"""-> 1: the job's way in (:data:`INTEND`), written at ARGV[3] or before, is dropped (a job
that is not to be admitted); 0: there is none, or a newer one (another gateway's): kept."""

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
local since = tonumber(redis.call('HGET', KEYS[1], 'resume_queued') or '') or 0
local lost = 1
if since == 0 then
  since = tonumber(redis.call('HGET', KEYS[1], 'plan_taken') or '') or 0
  lost = 2
end
if since == 0 or tonumber(ARGV[1]) - since < tonumber(ARGV[2]) then return 0 end
redis.call('HSET', KEYS[1], 'resume_queued', ARGV[1])
redis.call('HDEL', KEYS[1], 'plan_taken')
return lost
"""
"""-> 1: the plan task sent for this job ARGV[2] s ago or more was never run (lost, or
never sent: its sender died or the broker refused it); 2: the one a batch worker took
ARGV[2] s ago or more never got the job running with its window (:data:`PLAN_TAKEN`; its
worker was killed): the caller sends it again; 0: nothing to do."""

PLAN_TAKEN = """
-- KEYS: batch hash; ARGV: now (unix s), 1 for a plan task that resumes
if ARGV[2] == '1' then redis.call('HDEL', KEYS[1], 'resume_queued') end
local status = redis.call('HGET', KEYS[1], 'status')
if status ~= 'planning' and status ~= 'running' then return 0 end
redis.call('HSET', KEYS[1], 'plan_taken', ARGV[1])
return 1
"""
"""A batch worker runs the job's plan task: a resume from now on queues a plan task of its
own (this one reads the job after), and until :data:`PLAN_DONE` the job says a plan task
was taken at ARGV[1] (for :data:`RESEND`). -> 1: marked; 0: the job is not planning nor
running (nothing to mark)."""

PLAN_DONE = """
-- KEYS: batch hash; ARGV: when the plan task was taken (as PLAN_TAKEN wrote it)
if redis.call('HGET', KEYS[1], 'plan_taken') ~= ARGV[1] then return 0 end
return redis.call('HDEL', KEYS[1], 'plan_taken')
"""
"""The plan task taken at ARGV[1] is done: its mark goes (unless a newer task's replaced
it)."""

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

ADMITTING_GRACE_S = 300.0
"""How long an entry of :data:`INTEND` whose job is not ``queued`` is kept: its gateway may
still be between the two steps (each a Redis command, failing within seconds), or it
stopped before the job was written (or resumed) and the entry goes."""


def tenant_keys(keys: Keys, tenant: str) -> list[str]:
    """KEYS of :data:`ADMIT`, :data:`LEAVE`, :data:`INTEND` and :data:`LAPSE` (one hash
    slot: the namespace's)."""
    return [
        keys.tenant_running_batches(tenant),
        keys.tenant_queued_batches(tenant),
        keys.batch_turn_tenants,
        keys.tenant_admitting_batches(tenant),
    ]


_TENANT_KEYS = 4


def forget(redis: Redis, keys: Keys, tenant: str, batch_id: str) -> None:
    """Take a job out of its tenant's turns and line, giving no turn to another (a job
    removed; the periodic round gives the turn it held)."""
    redis.eval(LEAVE, _TENANT_KEYS, *tenant_keys(keys, tenant), tenant, 0, 0, batch_id)


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
                    ADMIT,
                    _TENANT_KEYS,
                    *tenant_keys(self.keys, tenant),
                    batch_id,
                    self.limit,
                    tenant,
                    now,
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
            _TENANT_KEYS,
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
        """The periodic round: for every tenant with turns, a job ``queued`` whose gateway
        stopped before it took a turn or a place in line takes one (:meth:`_admitting`),
        the turns of jobs that ended (their ender killed before it gave them on) go to the
        next in line, jobs given a turn that are still ``queued`` start, and a plan task
        never run, or whose batch worker was killed before the job ran, is sent again."""
        CLOCK.sync_blocking(self.redis)
        now = CLOCK.now()
        for raw in cast(set[bytes], self.redis.smembers(self.keys.batch_turn_tenants)):
            tenant = raw.decode()
            self._admitting(tenant, now)
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
                elif self.send_plan is not None:
                    lost = self.redis.eval(
                        RESEND, 1, self.keys.batch(batch_id), f"{now:.3f}", b.RESUME_QUEUED_S
                    )
                    if lost:
                        log.warning(
                            "batch %s: its plan task %s; sent again",
                            batch_id,
                            "was never run" if lost == 1 else "stopped with its batch worker",
                        )
                        self._send(batch_id)
            if self.send_plan is not None:
                self.start(tenant, waiting)
            if gone:
                log.info("batch jobs of tenant %s ended: %d turn(s) given on", tenant, len(gone))
            self.leave(tenant, *gone)  # (with none gone: gives the turns free, if any)

    def _admitting(self, tenant: str, now: float) -> None:
        """The tenant's jobs on their way in (:data:`INTEND`): one ``queued`` takes its turn
        or its place in line (its gateway stopped before it did, or is about to: admitting is
        idempotent), and starts below if it got a turn; one that is not and whose entry is
        older than :data:`ADMITTING_GRACE_S` is dropped (never written, or not resumed)."""
        key = self.keys.tenant_admitting_batches(tenant)
        for raw_id in cast(list[bytes], self.redis.zrange(key, 0, -1)):
            batch_id = raw_id.decode()
            status = cast(bytes | None, self.redis.hget(self.keys.batch(batch_id), b.F_STATUS))
            if status == b.QUEUED.encode():
                place = self.admit(tenant, batch_id)
                log.warning(
                    "batch %s: queued outside its tenant's turns and line (its gateway "
                    "stopped, or is slow); it %s",
                    batch_id,
                    "has a turn" if place == 0 else f"waits in line ({place})",
                )
            else:
                self.redis.eval(
                    LAPSE,
                    _TENANT_KEYS,
                    *tenant_keys(self.keys, tenant),
                    tenant,
                    batch_id,
                    f"{now - ADMITTING_GRACE_S:.3f}",
                )
