"""Offline batch jobs: what the gateway, the batch workers and the CLI agree on.

A batch job pushes a whole data set through one model version. The gateway checks the
request (:func:`parse_batch_request`), writes the job's record and hands a *plan* task to
Celery (broker: the deployment's Redis), or, while its tenant has
``SLUICE_TENANT_MAX_RUNNING_BATCHES`` jobs running, puts it in line (status ``queued``,
:mod:`sluice.core.batch_jobs.turns`) until one of them ends. A batch worker plans it
(counts the rows, splits them into shards of bounded work) and queues *shard* tasks, at most
``SLUICE_BATCH_SHARDS_IN_FLIGHT`` of the job at once (its window, :data:`DISPATCH`): the
next is sent as one ends, so a job of 100,000 shards neither fills Redis nor takes the
whole batch queue ahead of other tenants' jobs. Each shard task feeds its rows to the
model's background stream with a bounded number of requests in flight, writes its output
part under a name of its own attempt, and commits it with a script that accepts only the
shard's newest attempt: a zombie attempt (a worker thought dead that wakes up) cannot
overwrite a newer one. Completion is counted in Redis; the
attempt that commits the last shard writes the manifest (and, for local ``.npy`` output,
the outputs joined in input order).

Where: the input is one of the tenant's uploads (``upload:<id>``,
:mod:`sluice.core.batch_jobs.uploads`) or a location the operator allows the tenant
(:mod:`sluice.core.batch_jobs.access`); the outputs go to ``<output>/<batch id>/`` for an
allowed output location, else to the batch store under ``<tenant>/batches/<batch id>/``
(downloaded through the gateway). Every batch writes under its own id, so two batches never
touch each other's files.

Record layout: ``Keys.batch(id)`` (hash, fields below), ``Keys.batch_shards(id)`` (hash
shard index -> JSON state), ``Keys.batch_attempts(id)`` (hash shard index -> newest
attempt), ``Keys.batch_leases(id)`` (hash shard index -> when its running attempt's lease
ends), ``Keys.batch_in_flight(id)`` (hash shard index -> when it was sent: the window),
``Keys.batches(tenant)`` (sorted set id -> creation time, for listing). A finished
batch expires ``SLUICE_BATCH_RETENTION_S`` after it ended (``Keys.store_expiry``), with its
files in the store.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import PurePosixPath
from typing import Any

from sluice.core.batch_jobs.uploads import INPUT_PREFIX, is_upload_id
from sluice.core.errors import InvalidInput
from sluice.core.fields import integers, numbers

PLAN_TASK = "sluice.batch.plan"
SHARD_TASK = "sluice.batch.shard"
QUEUE = "sluice-batch"

QUEUED, PLANNING, RUNNING = "queued", "planning", "running"
COMPLETED, FAILED = "completed", "failed"
CANCELLING, CANCELLED = "cancelling", "cancelled"
FINISHED = (COMPLETED, FAILED, CANCELLED)

FORMATS = ("npy", "npz", "parquet", "jsonl")
MANIFEST = "_manifest.json"
MAX_SHARDS = 100_000
MAX_LISTED = 100

_ID = re.compile(r"[0-9a-f]{32}")
_MODEL = re.compile(r"[A-Za-z0-9_.-]{1,128}")


def new_batch_id() -> str:
    return uuid.uuid4().hex


def is_batch_id(value: str) -> bool:
    return bool(_ID.fullmatch(value))


@dataclass(frozen=True)
class BatchOptions:
    shard_rows: int = 65_536
    """Rows per shard: the unit of retry, resume and output part."""
    rows_per_request: int = 0
    """Rows per inference request (0: the model's max_batch_size)."""
    in_flight: int = 8
    """Requests one shard keeps queued at once."""
    input_format: str = ""
    """npy, npz, parquet or jsonl ('' : from the input's extension)."""
    output_format: str = ""
    """npy (one file per output), parquet or jsonl ('': jsonl for jsonl input, else npy)."""
    input_name: str = ""
    """For .npy input: the model input it feeds ('': the model's only input)."""
    max_retries: int = 3
    """Tries of a shard task (a worker lost, a Redis error) before the batch fails."""
    request_timeout_s: float = 600.0
    """Deadline of each inference request of the batch."""

    @classmethod
    def from_json(cls, body: Any) -> BatchOptions:
        if body is None:
            return cls()
        if not isinstance(body, dict):
            raise InvalidInput("'options' must be a JSON object")
        unknown = sorted(set(body) - set(cls.__dataclass_fields__))
        if unknown:
            raise InvalidInput(f"'options' has unknown field(s): {', '.join(unknown)[:200]}")
        values: dict[str, Any] = {
            **integers(
                body,
                (
                    ("shard_rows", 1, 100_000_000),
                    ("rows_per_request", 0, 1_000_000),
                    ("in_flight", 1, 1024),
                    ("max_retries", 0, 100),
                ),
                "options.",
            ),
            **numbers(body, (("request_timeout_s", 0.1, 86_400.0),), "options."),
        }
        for name in ("input_format", "output_format"):
            if name in body:
                value = body[name]
                if value not in ("", *FORMATS):
                    raise InvalidInput(f"'options.{name}' must be one of {', '.join(FORMATS)}")
                values[name] = value
        if "input_name" in body:
            value = body["input_name"]
            if not isinstance(value, str) or len(value) > 256:
                raise InvalidInput("'options.input_name' must be a model input's name")
            values["input_name"] = value
        if values.get("output_format") == "npz":
            raise InvalidInput("'options.output_format' npz is not written: use npy")
        return cls(**values)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class BatchRequest:
    model: str
    version: int | None
    input: str
    output: str
    options: BatchOptions


def check_input_name(options: BatchOptions, model: str, inputs: Sequence[str]) -> None:
    """400 naming ``options.input_name`` and the model's inputs when it names none of
    them (checked at submission against the model as served then; the batch worker checks
    it again against the model as it is when the job runs)."""
    if options.input_name and options.input_name not in inputs:
        raise InvalidInput(
            f"'options.input_name' must be one of the inputs of model '{model}': "
            f"{', '.join(inputs)[:1000]}"
        )


def format_of(location: str, given: str) -> str:
    """The data format of ``location``: ``given``, else its extension."""
    if given:
        return given
    suffix = PurePosixPath(location.rstrip("/")).suffix.lstrip(".").lower()
    if suffix == "parquet" or suffix == "pq":
        return "parquet"
    if suffix in ("jsonl", "ndjson"):
        return "jsonl"
    if suffix in ("npy", "npz"):
        return suffix
    raise InvalidInput(
        f"cannot tell the format of '{location[:200]}' from its extension: name it with "
        "'options.input_format' (npy, npz, parquet or jsonl)"
    )


def check_location(value: Any, field: str) -> str:
    """A data location as a client names it: an absolute local path or ``s3://bucket/key``
    (and for the input, ``upload:<id>``). Only its form is checked here; whether the tenant
    may use it is :mod:`sluice.core.batch_jobs.access`'s, at submission and where it is opened."""
    if not isinstance(value, str) or not value:
        raise InvalidInput(f"'{field}' must be a path or an s3:// URL")
    if len(value) > 4096 or "\0" in value or any(ord(c) < 32 for c in value):
        raise InvalidInput(f"'{field}' is not a valid path")
    if value.startswith(INPUT_PREFIX) and field == "input":
        if not is_upload_id(value[len(INPUT_PREFIX) :]):
            raise InvalidInput(f"'{field}': '{value[:80]}' is not 'upload:<upload id>'")
        return value
    if value.startswith("s3://"):
        bucket, _, key = value[5:].partition("/")
        if not re.fullmatch(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]", bucket):
            raise InvalidInput(f"'{field}': '{bucket[:80]}' is not an S3 bucket name")
        if any(part in (".", "..") for part in key.split("/")):
            raise InvalidInput(f"'{field}' must not contain '..' or '.' segments")
        return value
    if "://" in value:
        raise InvalidInput(f"'{field}': only local paths and s3:// URLs are supported")
    if not value.startswith("/"):
        raise InvalidInput(f"'{field}' must be an absolute path (the CLI makes it absolute)")
    if ".." in PurePosixPath(value).parts:
        raise InvalidInput(f"'{field}' must not contain '..'")
    return value


def is_upload_input(location: str) -> bool:
    return location.startswith(INPUT_PREFIX)


def upload_of(location: str) -> str:
    """The upload id of an ``upload:<id>`` input."""
    return location[len(INPUT_PREFIX) :]


def parse_batch_request(body: Any, upload_name: str = "") -> BatchRequest:
    """``POST /v2/batches``'s body, checked field by field. ``upload_name``: the name of the
    upload an ``upload:<id>`` input names (its extension tells the format). ``output``
    left out (or ``""``): the batch store."""
    if not isinstance(body, dict):
        raise InvalidInput("the batch request must be a JSON object")
    unknown = sorted(set(body) - {"model", "version", "input", "output", "options"})
    if unknown:
        raise InvalidInput(f"unknown field(s): {', '.join(unknown)[:200]}")
    model = body.get("model")
    if not isinstance(model, str) or not _MODEL.fullmatch(model):
        raise InvalidInput("'model' must be a model name")
    version = body.get("version")
    if version is not None and (
        isinstance(version, bool) or not isinstance(version, int) or not 0 < version < 1 << 63
    ):
        raise InvalidInput("'version' must be a positive integer")
    options = BatchOptions.from_json(body.get("options"))
    source = check_location(body.get("input"), "input")
    output = body.get("output")
    target = "" if output is None or output == "" else check_location(output, "output")
    input_format = format_of(upload_name or source, options.input_format)
    output_format = options.output_format or ("jsonl" if input_format == "jsonl" else "npy")
    if (input_format == "jsonl") != (output_format == "jsonl"):
        raise InvalidInput("JSON Lines input (v2 requests) goes with JSON Lines output only")
    options = BatchOptions(
        **{**options.to_json(), "input_format": input_format, "output_format": output_format}
    )
    return BatchRequest(model, version, source, target, options)


# Fields of a batch's hash.
F_STATUS, F_MODEL, F_VERSION, F_INPUT, F_OUTPUT = "status", "model", "version", "input", "output"
F_OPTIONS, F_CREATED, F_STARTED, F_FINISHED = "options", "created", "started", "finished"
F_ROWS_TOTAL, F_ROWS_DONE, F_SHARDS, F_SHARDS_DONE = (
    "rows_total",
    "rows_done",
    "shards",
    "shards_done",
)
F_ERROR, F_MANIFEST, F_OWNER, F_RETRIES = "error", "manifest", "owner", "retries"
F_SHARDS_FAILED = "shards_failed"
F_FILES = "files"
"""JSON list of ``{"name", "bytes"}``: every file of a completed batch (the manifest, the
parts, the joined outputs), what ``GET /v2/batches/{id}/outputs`` lists and serves."""
F_RESUME_QUEUED = "resume_queued"
"""When (the deployment's unix s) a resume last queued a plan task that no batch worker
has run yet; removed as one runs it (see :data:`RESUME`)."""
F_PLAN_TAKEN = "plan_taken"
"""When (the deployment's unix s) a batch worker took the job's plan task, until that task
has the job running with its window sent (see :data:`sluice.core.batch_jobs.turns.RESEND`)."""
RESUME_QUEUED_S = 900.0
"""How long a queued resume holds back the next ones: a plan task not run by then counts
as lost (a broker that lost it), and the next resume queues one again."""
F_NEXT_SHARD = "next_shard"
"""The lowest shard :data:`DISPATCH` has not looked at yet (the window's cursor). A job
planned by batch workers of before the window has none: all its shards were queued as it
was planned, and nothing more is sent (until a resume, which sets it)."""
F_STORED = "stored_bytes"
"""Bytes this batch counted in the batch store against its tenant, as batch workers of
0.1.0 counted them (now in ``Keys.batch_stored``, see
:mod:`sluice.core.batch_jobs.output_quota`); still given back when the batch is removed."""

START = """
-- KEYS: batch hash; ARGV: field, value, ... (the fields of the batch once planned)
if redis.call('HGET', KEYS[1], 'status') ~= 'planning' then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV))
return 1
"""
"""-> 1: the batch runs now; 0: it is no longer planning (cancelled while it was planned):
nothing is written, so a cancel that came first is never undone."""

END = """
-- KEYS: batch hash; ARGV: field, value, ... (the final status and what goes with it)
local status = redis.call('HGET', KEYS[1], 'status')
if status ~= 'planning' and status ~= 'running' then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV))
return 1
"""
"""-> 1: the batch ended so; 0: it had ended already (cancelled while its outputs were
written up): nothing is written, so a cancel that came first is never undone."""

CANCEL = """
-- KEYS: batch hash; ARGV: finished (unix s)
local status = redis.call('HGET', KEYS[1], 'status')
if status ~= 'queued' and status ~= 'planning' and status ~= 'running' then return status end
redis.call('HSET', KEYS[1], 'status', 'cancelled', 'finished', ARGV[1])
return 'cancelled'
"""
"""-> the job's status after the cancel (false: no such job). Only a job still waiting for
its turn, planning or running is cancelled: one that ended meanwhile (its last shard
committed as the cancel came) stays as it ended."""

RESUME = """
-- KEYS: batch hash; ARGV: now (unix s), how long a queued resume holds (s)
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return {} end
if status == 'completed' or status == 'queued' then return {status, status, 0} end
if status == 'failed' or status == 'cancelled' then
  redis.call('HSET', KEYS[1], 'status', 'queued', 'error', '', 'finished', '')
  return {status, 'queued', 0}
end
local shards = redis.call('HGET', KEYS[1], 'shards')
local next = 'planning'
if shards and shards ~= '' then next = 'running' end
redis.call('HSET', KEYS[1], 'status', next, 'error', '', 'finished', '')
local queued = tonumber(redis.call('HGET', KEYS[1], 'resume_queued') or '') or 0
if queued > 0 and tonumber(ARGV[1]) - queued < tonumber(ARGV[2]) then
  return {status, next, 0}
end
redis.call('HSET', KEYS[1], 'resume_queued', ARGV[1])
return {status, next, 1}
"""
"""-> {the job's status before, its status once resumed, 1 when the caller queues the plan
task that resumes it}: ``running``, or ``planning`` when it was never planned;
``completed`` when it is (nothing is changed: it completed, perhaps as the resume came);
``queued`` for a job that had ended (failed, cancelled): it waits for a turn of its tenant's
(:mod:`sluice.core.batch_jobs.turns`), and the caller gives it one or puts it in line; and
for one waiting already (nothing is changed); {} when there is no such job. One resume
waits for a batch worker at a time (the field ``resume_queued``, younger than ARGV[2]): a
resume while it waits sets the status alone, and the waiting one resumes what there is when
it runs, so that a client resuming in a loop queues one plan task, not one per call (each
sends every shard not committed)."""

ADD = """
-- KEYS: the tenant's batches; ARGV: batch id, created (unix s), the tenant's max batches
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[3]) then return 0 end
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[1])
return 1
"""
"""List a new batch job among its tenant's (1), unless the tenant keeps as many as it may
(0)."""

COMMIT = """
-- KEYS: batch hash, shard states, attempts, leases; ARGV: shard, attempt, state (JSON)
local status = redis.call('HGET', KEYS[1], 'status')
if status ~= 'running' then return -1 end
if tonumber(redis.call('HGET', KEYS[3], ARGV[1]) or '0') ~= tonumber(ARGV[2]) then return -2 end
local state = redis.call('HGET', KEYS[2], ARGV[1])
if state and string.find(state, '"committed"', 1, true) then return -3 end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[3])
redis.call('HDEL', KEYS[4], ARGV[1])
local done = redis.call('HINCRBY', KEYS[1], 'shards_done', 1)
local failed = tonumber(redis.call('HGET', KEYS[1], 'shards_failed') or '0')
if done + failed == tonumber(redis.call('HGET', KEYS[1], 'shards')) then return 1 end
return 0
"""
"""-> 1: this commit was the batch's last shard (finish it: the manifest, or the failure);
0: committed; -1: the batch is not running (cancelled, failed); -2: a newer attempt of the
shard exists (this one is a zombie); -3: the shard was committed already."""

FAIL_SHARD = """
-- KEYS: batch hash, shard states, attempts, leases; ARGV: shard, attempt, state (JSON)
local status = redis.call('HGET', KEYS[1], 'status')
if status ~= 'running' then return -1 end
if tonumber(redis.call('HGET', KEYS[3], ARGV[1]) or '0') ~= tonumber(ARGV[2]) then return -2 end
local state = redis.call('HGET', KEYS[2], ARGV[1])
if state and (string.find(state, '"committed"', 1, true)
    or string.find(state, '"error"', 1, true)) then
  return -3
end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[3])
redis.call('HDEL', KEYS[4], ARGV[1])
local failed = redis.call('HINCRBY', KEYS[1], 'shards_failed', 1)
local done = tonumber(redis.call('HGET', KEYS[1], 'shards_done') or '0')
if done + failed == tonumber(redis.call('HGET', KEYS[1], 'shards')) then return 1 end
return 0
"""
"""As COMMIT, for a shard that failed for good (its error kept in its state)."""

TAKE = """
-- KEYS: batch hash, shard states, attempts, leases; ARGV: shard, now (unix s), lease s
if redis.call('HGET', KEYS[1], 'status') ~= 'running' then return -1 end
local state = redis.call('HGET', KEYS[2], ARGV[1])
if state and string.find(state, '"committed"', 1, true) then return -3 end
local lease = tonumber(redis.call('HGET', KEYS[4], ARGV[1]) or '0')
if lease > tonumber(ARGV[2]) then return 0 end
redis.call('HSET', KEYS[4], ARGV[1], tonumber(ARGV[2]) + tonumber(ARGV[3]))
return redis.call('HINCRBY', KEYS[3], ARGV[1], 1)
"""
"""-> the new attempt's number; 0: a live attempt holds the shard (its lease runs: this is a
redelivery of a message still being worked on); -1: the batch is not running; -3: the shard
is committed already."""

RENEW = """
-- KEYS: attempts, leases; ARGV: shard, attempt, until (unix s)
if tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '0') ~= tonumber(ARGV[2]) then return 0 end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[3])
return 1
"""
"""-> 1 renewed; 0 a newer attempt took the shard over (this one must stop)."""

LET_GO = """
-- KEYS: batch hash, shard states, attempts, leases; ARGV: shard, attempt
if redis.call('HGET', KEYS[1], 'status') == 'running' then return 0 end
if tonumber(redis.call('HGET', KEYS[3], ARGV[1]) or '0') ~= tonumber(ARGV[2]) then return 0 end
return redis.call('HDEL', KEYS[4], ARGV[1])
"""
"""-> 1: the lease of an attempt that stopped (it no longer runs) is given up, as the batch
is not running (cancelled, stopped): a resume sends the shard again at once rather than
leave it to the reaper once the lease has run out; 0: kept (the batch runs: a resume came
first and skipped the shard as held, so the reaper queues it once the lease runs out)."""

DISPATCH = """
-- KEYS: batch hash, shard states, leases, in flight
-- ARGV: window, now (unix s), resend after (s), most shards the cursor passes
if redis.call('HGET', KEYS[1], 'status') ~= 'running' then return {0} end
local cursor = tonumber(redis.call('HGET', KEYS[1], 'next_shard') or '')
if not cursor then return {0} end
local shards = tonumber(redis.call('HGET', KEYS[1], 'shards') or '0')
local window, now = tonumber(ARGV[1]), tonumber(ARGV[2])
local function ended(shard)
  local state = redis.call('HGET', KEYS[2], shard)
  return state and (string.find(state, '"committed"', 1, true)
    or string.find(state, '"error"', 1, true))
end
local sent, count = {0}, 0
local flying = redis.call('HGETALL', KEYS[4])
for i = 1, #flying, 2 do
  local shard = flying[i]
  if ended(shard) then
    redis.call('HDEL', KEYS[4], shard)
  else
    count = count + 1
    if now - tonumber(flying[i + 1]) >= tonumber(ARGV[3])
        and redis.call('HEXISTS', KEYS[3], shard) == 0 then
      redis.call('HSET', KEYS[4], shard, ARGV[2])
      table.insert(sent, tonumber(shard))
    end
  end
end
local budget = tonumber(ARGV[4])
while count < window and cursor < shards and budget > 0 do
  local shard = tostring(cursor)
  if not ended(shard) and redis.call('HEXISTS', KEYS[4], shard) == 0 then
    redis.call('HSET', KEYS[4], shard, ARGV[2])
    table.insert(sent, cursor)
    count = count + 1
  end
  cursor = cursor + 1
  budget = budget - 1
end
redis.call('HSET', KEYS[1], 'next_shard', cursor)
if count < window and cursor < shards then sent[1] = 1 end
return sent
"""
"""-> {1 when the caller calls again (the cursor passed ARGV[4] shards, ended ones after a
resume, and the window has room still), then the shards the caller sends now}. The window
of a running job: the shards it has in flight (``Keys.batch_in_flight``) that ended
(committed, or failed for good) leave it, and shards from the cursor on fill it up to
ARGV[1] (one that ended, or is in flight already, is passed over). One sent ARGV[3] s ago or
more that no attempt ever leased (its message lost: the worker that was to send it died, or
the broker refused it) is sent again. Atomic, so that two batch workers whose shards end at
once never send the same next shard, nor skip one. Nothing for a job not running (cancelled,
failed) nor for one planned before the window (no ``next_shard``)."""

REWIND = """
-- KEYS: batch hash, shard states, leases, in flight; ARGV: lowest shard not committed, now
if redis.call('HGET', KEYS[1], 'status') ~= 'running' then return 0 end
redis.call('DEL', KEYS[4])
local leases = redis.call('HGETALL', KEYS[3])
for i = 1, #leases, 2 do
  local state = redis.call('HGET', KEYS[2], leases[i])
  if tonumber(leases[i + 1]) > tonumber(ARGV[2])
      and not (state and string.find(state, '"committed"', 1, true)) then
    redis.call('HSET', KEYS[4], leases[i], ARGV[2])
  end
end
redis.call('HSET', KEYS[1], 'next_shard', ARGV[1])
return 1
"""
"""-> 1: a resumed job's window starts again: in flight are the shards a live attempt holds
(its lease not run out), and the cursor goes back to the lowest shard not committed, so that
:data:`DISPATCH` sends again, in turn, every shard that is lost (not committed, nobody
computing it); 0: the job is not running (cancelled again), nothing changed. A job planned
before the window gets one so."""
