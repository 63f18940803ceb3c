"""Asynchronous jobs: an inference request whose answer is kept in Redis instead of being
sent to a waiting gateway.

A job is an ordinary request entry on its model version's background stream
(``Keys.background_stream``: workers serve it after every online request), whose reply
address is the job's record (``Keys.job``, a hash). The gateway creates the record and the
entry in one script; the worker that computes the request writes the answer into the record
(the same encoded reply a gateway would read from its reply stream), so no particular gateway
has to be alive for a job to finish, and the result is served in exactly the synchronous
format.

Statuses: ``queued`` -> ``in_progress`` -> ``completed`` | ``failed`` | ``expired`` (its
deadline passed before a worker computed it); ``cancelling`` (a worker holds it) ->
``cancelled``. Every transition is one Redis script that checks the current status, so a
duplicate answer (a request delivered twice), an answer to a cancelled job, or a cancel after
completion changes nothing.
"""

from __future__ import annotations

import re
import time
import uuid
from dataclasses import dataclass
from typing import Any

import msgpack

from sluice.core.keys import Keys
from sluice.core.wire import DATA_FIELD, HEADER_FIELD, ReplyMessage, encode_reply

QUEUED, IN_PROGRESS, COMPLETED, FAILED, EXPIRED = (
    "queued",
    "in_progress",
    "completed",
    "failed",
    "expired",
)
CANCELLING, CANCELLED = "cancelling", "cancelled"
STATUSES = (QUEUED, IN_PROGRESS, COMPLETED, FAILED, EXPIRED, CANCELLING, CANCELLED)
FINISHED = (COMPLETED, FAILED, EXPIRED, CANCELLED)

JOB_ID = re.compile(r"[0-9a-f]{32}")
"""Job ids are 32 lowercase hex digits (a uuid4): anything else is refused before Redis."""

MAX_IDEMPOTENCY_KEY = 256


def new_job_id() -> str:
    return uuid.uuid4().hex


def is_job_id(value: str) -> bool:
    return bool(JOB_ID.fullmatch(value))


# Fields of a job's hash.
F_STATUS, F_MODEL, F_VERSION = "status", "model", "version"
F_CREATED, F_STARTED, F_FINISHED = "created", "started", "finished"
F_STREAM, F_ENTRY, F_OUTPUTS = "stream", "entry", "outputs"
F_REPLY, F_DATA, F_ERROR, F_ERROR_KIND = "reply", "data", "error", "error_kind"
F_RETENTION, F_REQUEST_ID, F_KEY = "retention", "request_id", "idempotency_key"
F_OWNER, F_CLIENT_ID = "owner", "client_id"
F_RESULT_LIMIT = "result_limit"
"""The bytes of answers its tenant's finished jobs of the model may keep, as the job's
gateway was told (SLUICE_TENANT_MAX_JOB_RESULT_BYTES): FINISH keeps no answer past it."""

_RELEASE = """
local function release(room, queued, id)
  local held = redis.call('HGET', room, id)
  if not held then return 0 end
  local space = string.find(held, ' ', 1, true)
  local bytes, tenant = string.sub(held, 1, space - 1), string.sub(held, space + 1)
  redis.call('HDEL', room, id)
  redis.call('ZREM', queued, id)
  if redis.call('HINCRBY', room, 'n:' .. tenant, -1) <= 0 then
    redis.call('HDEL', room, 'n:' .. tenant)
  end
  if redis.call('HINCRBY', room, 'b:' .. tenant, '-' .. bytes) <= 0 then
    redis.call('HDEL', room, 'b:' .. tenant)
  end
  return 1
end
"""
"""The tenant's room a queued job held (``Keys.job_room``, ``Keys.queued_jobs``) given
back: idempotent (a job holds room once, and gives it back once), so every transition out
of ``queued`` may call it."""

_RESULTS = """
local function forget(results, finished, id)
  redis.call('ZREM', finished, id)
  local held = redis.call('HGET', results, id)
  if not held then return 0 end
  local space = string.find(held, ' ', 1, true)
  local bytes, tenant = string.sub(held, 1, space - 1), string.sub(held, space + 1)
  redis.call('HDEL', results, id)
  if redis.call('HINCRBY', results, 'r:' .. tenant, 0 - tonumber(bytes)) <= 0 then
    redis.call('HDEL', results, 'r:' .. tenant)
  end
  return 1
end
local function keep(results, finished, id, tenant, bytes, expires, ttl)
  redis.call('HSET', results, id, bytes .. ' ' .. tenant)
  redis.call('HINCRBY', results, 'r:' .. tenant, bytes)
  redis.call('ZADD', finished, expires, id)
  for _, key in ipairs({results, finished}) do
    if redis.call('TTL', key) < ttl then redis.call('EXPIRE', key, ttl) end
  end
end
"""
"""What each tenant's finished jobs hold until their retention ends (``Keys.job_results``,
``Keys.finished_jobs``): ``keep`` counts a job's answer once it is written, ``forget`` gives
it back (idempotent) when the job is deleted or the next submission finds it expired."""

_SWEEP_AT_ONCE = 1000
"""Expired jobs one submission gives back at most (each expires once: this only spreads
the work of a large expiry over the submissions that follow)."""

SUBMIT = (
    _RELEASE
    + _RESULTS
    + """
-- KEYS: job hash, stream, idempotency key (or the job hash again when none), the model
-- version's statistics hash, the model's queued jobs, the model's job room, the version's
-- set of tenant streams, the level's base stream (the stream itself without a tenant),
-- the model's job results, the model's finished jobs
-- ARGV: job id, created (unix s), retention s, queue ttl s, max queued, model, version,
--       outputs, request id, idempotency key, owner (tenant), client's id, request digest,
--       tenant's max queued jobs, tenant's max queued bytes, the entry's bytes, tenant's
--       max result bytes, then the entry's field/value pairs
if KEYS[3] ~= KEYS[1] then
  local existing = redis.call('GET', KEYS[3])
  if existing then
    local space = string.find(existing, ' ', 1, true)
    if not space then return {0, existing} end
    local id = string.sub(existing, 1, space - 1)
    if string.sub(existing, space + 1) ~= ARGV[13] then return {-3, id} end
    return {0, id}
  end
end
if tonumber(ARGV[5]) > 0 then
  -- The level's depth: its base stream and its tenants' streams (all in this slot).
  local depth = redis.call('XLEN', KEYS[8])
  local prefix = KEYS[8] .. ':t:'
  for _, stream in ipairs(redis.call('SMEMBERS', KEYS[7])) do
    if string.sub(stream, 1, #prefix) == prefix then depth = depth + redis.call('XLEN', stream) end
  end
  if depth >= tonumber(ARGV[5]) then return {-1, ''} end
end
local expired = redis.call('ZRANGEBYSCORE', KEYS[5], '-inf', ARGV[2], 'LIMIT', 0, """
    + str(_SWEEP_AT_ONCE)
    + """)
for _, id in ipairs(expired) do release(KEYS[6], KEYS[5], id) end
local tenant = ARGV[11]
local count = tonumber(redis.call('HGET', KEYS[6], 'n:' .. tenant) or '0')
if count >= tonumber(ARGV[14]) then return {-2, tostring(count)} end
local held = tonumber(redis.call('HGET', KEYS[6], 'b:' .. tenant) or '0')
if held + tonumber(ARGV[16]) > tonumber(ARGV[15]) then return {-4, tostring(held)} end
local gone = redis.call('ZRANGEBYSCORE', KEYS[10], '-inf', ARGV[2], 'LIMIT', 0, """
    + str(_SWEEP_AT_ONCE)
    + """)
for _, id in ipairs(gone) do forget(KEYS[9], KEYS[10], id) end
local kept = tonumber(redis.call('HGET', KEYS[9], 'r:' .. tenant) or '0')
if kept >= tonumber(ARGV[17]) then return {-5, tostring(kept)} end
local fields = {}
for i = 18, #ARGV do fields[#fields + 1] = ARGV[i] end
local entry = redis.call('XADD', KEYS[2], '*', unpack(fields))
redis.call('HSET', KEYS[1], 'status', 'queued', 'model', ARGV[6], 'version', ARGV[7],
  'created', ARGV[2], 'stream', KEYS[2], 'entry', entry, 'outputs', ARGV[8],
  'retention', ARGV[3], 'request_id', ARGV[9], 'idempotency_key', ARGV[10],
  'owner', ARGV[11], 'client_id', ARGV[12], 'result_limit', ARGV[17])
local ttl = tonumber(ARGV[4]) + tonumber(ARGV[3])
redis.call('EXPIRE', KEYS[1], ttl)
if KEYS[3] ~= KEYS[1] then redis.call('SET', KEYS[3], ARGV[1] .. ' ' .. ARGV[13], 'EX', ttl) end
redis.call('HSET', KEYS[6], ARGV[1], ARGV[16] .. ' ' .. tenant)
redis.call('HINCRBY', KEYS[6], 'n:' .. tenant, 1)
redis.call('HINCRBY', KEYS[6], 'b:' .. tenant, ARGV[16])
redis.call('ZADD', KEYS[5], tonumber(ARGV[2]) + tonumber(ARGV[4]), ARGV[1])
-- Every job in them has stopped waiting by then (all wait the same queue ttl at most).
redis.call('EXPIRE', KEYS[5], tonumber(ARGV[4]) + 60)
redis.call('EXPIRE', KEYS[6], tonumber(ARGV[4]) + 60)
redis.call('HINCRBY', KEYS[4], 'job.submitted', 1)
return {1, ARGV[1]}
"""
)
"""-> {1, id} created; {0, id} an earlier job with the same idempotency key and request;
{-3, id} an earlier job with the same idempotency key and another request; {-1, ''} the
model version's job queue is full; {-2, jobs} / {-4, bytes} the tenant's queued jobs of this
model are as many, or would hold as many bytes, as it may have; {-5, bytes} the answers of
its finished jobs of this model, kept until their retention ends, hold as many bytes as it
may keep. Counts ``job.<status>`` in
the statistics hash, as FINISH and CANCEL do (``sluice_jobs_total``).

A queued job holds room in its tenant's account (:meth:`sluice.core.keys.Keys.job_room`) until
it leaves the queue: a worker starts it (START), it is answered (FINISH: also when it
expired, or failed before it started), cancelled (CANCEL), or its wait ends unanswered (the
next submission for the model sweeps it from :meth:`sluice.core.keys.Keys.queued_jobs`)."""

START = (
    _RELEASE
    + """
-- KEYS: the model's queued jobs, the model's job room, then job hashes
-- ARGV: started (unix s), then the jobs' ids (in the order of their hashes)
for i = 3, #KEYS do
  release(KEYS[2], KEYS[1], ARGV[i - 1])
  if redis.call('HGET', KEYS[i], 'status') == 'queued' then
    redis.call('HSET', KEYS[i], 'status', 'in_progress', 'started', ARGV[1])
  end
end
return 0
"""
)

FINISH = (
    _RELEASE
    + _RESULTS
    + """
-- KEYS: job hash, the model version's statistics hash, the model's queued jobs, the
-- model's job room, the model's job results, the model's finished jobs; ARGV: status
-- (completed, failed, expired), reply header, data, finished (unix s), error, error kind,
-- job id
release(KEYS[4], KEYS[3], ARGV[7])
local status = redis.call('HGET', KEYS[1], 'status')
local answered = false
if status == 'cancelling' then
  redis.call('HSET', KEYS[1], 'status', 'cancelled', 'finished', ARGV[4])
  redis.call('HINCRBY', KEYS[2], 'job.cancelled', 1)
elseif status == 'queued' or status == 'in_progress' then
  local outcome, reply, data, err, kind = ARGV[1], ARGV[2], ARGV[3], ARGV[5], ARGV[6]
  local limit = tonumber(redis.call('HGET', KEYS[1], 'result_limit') or '0') or 0
  if limit > 0 and #KEYS >= 6 then
    -- The tenant's answers kept at its limit already (its jobs queued before it was
    -- reached are answered now): this one is not kept, the job fails saying why.
    local gone = redis.call('ZRANGEBYSCORE', KEYS[6], '-inf', ARGV[4], 'LIMIT', 0, """
    + str(_SWEEP_AT_ONCE)
    + """)
    for _, id in ipairs(gone) do forget(KEYS[5], KEYS[6], id) end
    local owner = redis.call('HGET', KEYS[1], 'owner') or ''
    local kept = tonumber(redis.call('HGET', KEYS[5], 'r:' .. owner) or '0')
    if kept >= limit then
      local model = redis.call('HGET', KEYS[1], 'model') or ''
      outcome, reply, data, kind = 'failed', '', '', 'QuotaExceeded'
      err = "the answer (" .. (#ARGV[2] + #ARGV[3]) .. " bytes) was not kept: tenant '"
        .. owner .. "' keeps " .. kept .. " bytes of answers of finished jobs of model '"
        .. model .. "', its limit (SLUICE_TENANT_MAX_JOB_RESULT_BYTES=" .. limit
        .. "); delete finished jobs (DELETE /v2/jobs/{id}), then submit it again"
    end
  end
  redis.call('HSET', KEYS[1], 'status', outcome, 'reply', reply, 'data', data,
    'finished', ARGV[4], 'error', err, 'error_kind', kind)
  redis.call('HINCRBY', KEYS[2], 'job.' .. outcome, 1)
  answered = true
else
  return 0
end
local retention = tonumber(redis.call('HGET', KEYS[1], 'retention') or '0')
if retention and retention > 0 then
  redis.call('EXPIRE', KEYS[1], retention)
  if answered and #KEYS >= 6 then
    local owner = redis.call('HGET', KEYS[1], 'owner') or ''
    local fields = {'reply', 'data', 'error'}
    local bytes = 0
    for _, name in ipairs(fields) do bytes = bytes + redis.call('HSTRLEN', KEYS[1], name) end
    keep(KEYS[5], KEYS[6], ARGV[7], owner, bytes, tonumber(ARGV[4]) + retention,
      math.ceil(retention) + 60)
  end
end
return 1
"""
)
"""-> 1 when this answer changed the job (0: gone, finished already, or cancelled). The
answer is kept, and counted in its tenant's results account, unless the tenant's kept
answers of the model are at its limit (``result_limit``, from the job's submission)
already: the job then fails with a QuotaExceeded (429) naming the limit, and keeps only
that error. SUBMIT checks the same limit, but the jobs a tenant queued before reaching it
are answered later: without this check their answers would all be kept, past it."""

CANCEL = (
    _RELEASE
    + """
-- KEYS: job hash, its stream, the model version's statistics hash, the model's queued
-- jobs, the model's job room; ARGV: finished (unix s), job id
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return false end
if status == 'queued' or status == 'in_progress' then
  local entry = redis.call('HGET', KEYS[1], 'entry')
  local removed = 0
  if status == 'queued' and entry then removed = redis.call('XDEL', KEYS[2], entry) end
  if removed == 1 then
    release(KEYS[5], KEYS[4], ARGV[2])
    redis.call('HSET', KEYS[1], 'status', 'cancelled', 'finished', ARGV[1])
    redis.call('HINCRBY', KEYS[3], 'job.cancelled', 1)
    local retention = tonumber(redis.call('HGET', KEYS[1], 'retention') or '0')
    if retention and retention > 0 then redis.call('EXPIRE', KEYS[1], retention) end
    return 'cancelled'
  end
  redis.call('HSET', KEYS[1], 'status', 'cancelling')
  return 'cancelling'
end
return status
"""
)
"""-> the job's status after the request (nil: no such job). A queued job whose entry is
removed from its stream is cancelled at once (and gives its tenant's room back); one a
worker holds is ``cancelling`` until that worker's answer arrives (and is dropped)."""


REMOVE = (
    _RESULTS
    + """
-- KEYS: job hash, its idempotency key (or the job hash again when none), the model's job
-- results, the model's finished jobs; ARGV: job id
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return false end
if status == 'completed' or status == 'failed' or status == 'expired'
    or status == 'cancelled' then
  redis.call('DEL', KEYS[1])
  if KEYS[2] ~= KEYS[1] then redis.call('DEL', KEYS[2]) end
  forget(KEYS[3], KEYS[4], ARGV[1])
end
return status
"""
)
"""-> the job's status (nil: no such job). A finished job is deleted with its answer (what it
held in its tenant's results account given back); any other is left as it is."""


@dataclass(frozen=True, slots=True)
class JobOutput:
    """An output the job's client asked for, and how it wants it."""

    name: str
    binary: bool
    classes: int = 0


def encode_outputs(outputs: list[JobOutput]) -> bytes:
    packed: bytes = msgpack.packb([[o.name, o.binary, o.classes] for o in outputs])
    return packed


def decode_outputs(raw: bytes) -> list[JobOutput]:
    rows: Any = msgpack.unpackb(raw, raw=False)
    return [JobOutput(str(name), bool(binary), int(classes)) for name, binary, classes in rows]


def finish_call(
    keys: Keys, model: str, version: int, job: str, reply: ReplyMessage, payload: bytes = b""
) -> tuple[list[str], list[Any]]:
    """The keys and arguments of :data:`FINISH` that answer the job whose hash is ``job``
    with ``reply`` (its ``request_key`` is the job's id)."""
    fields = encode_reply(reply, payload)
    call_keys = [
        job,
        keys.stats(model, version),
        keys.queued_jobs(model),
        keys.job_room(model),
        keys.job_results(model),
        keys.finished_jobs(model),
    ]
    args: list[Any] = [
        status_of_answer(reply.error_kind),
        fields[HEADER_FIELD],
        fields[DATA_FIELD],
        f"{time.time():.6f}",
        reply.error,
        reply.error_kind,
        reply.request_key,
    ]
    return call_keys, args


def status_of_answer(error_kind: str) -> str:
    """The job's status once a worker answered with this error kind ('' for success)."""
    if not error_kind:
        return COMPLETED
    return EXPIRED if error_kind == "DeadlineExceeded" else FAILED
