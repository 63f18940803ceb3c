"""Asynchronous jobs in the gateway (see :mod:`sluice.core.jobs`): submission with
``Prefer: respond-async`` on the inference route, status, result and cancellation.

A job goes through exactly the validation of a synchronous request
(:func:`sluice.gateway.inference.data_plane.prepare`), then its entry and its record are
written by one script, which refuses it when the model version already has
``SLUICE_MAX_QUEUED_JOBS`` waiting (503), or when the tenant's waiting jobs of the model are
``SLUICE_TENANT_MAX_QUEUED_JOBS`` or would hold more than
``SLUICE_TENANT_MAX_QUEUED_JOB_BYTES`` (429, that tenant alone). A repeated
``Idempotency-Key`` (or request ``id``) of the tenant returns the earlier job when the
request is the same (a digest of it is kept with the key), and 409 when it is another. Jobs
queue on the model version's background stream, below every online request, unless the
request sets its ``priority``. Nothing is accepted while Redis is nearly full
(:mod:`sluice.gateway.redis_room`).

A job belongs to the tenant whose API key submitted it (:mod:`sluice.core.tenants`; its name is
kept in the record): for another tenant, it is not found. Job ids are 128-bit random, never
derived from input.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import hashlib
import re
import time
from dataclasses import dataclass
from typing import Any, cast

import orjson
from redis.exceptions import RedisError

from sluice.core import jobs
from sluice.core.cancellation import NOTICES_MAX_LEN, notice_fields
from sluice.core.errors import (
    Conflict,
    InvalidInput,
    NotFound,
    Overloaded,
    PayloadTooLarge,
    QuotaExceeded,
    SluiceError,
    Unsupported,
    error_from_kind,
)
from sluice.core.keys import base_stream
from sluice.core.observability.trace_context import TraceParent
from sluice.core.tenants import ANONYMOUS
from sluice.core.wire import DATA_FIELD, HEADER_FIELD, decode_reply, encode_request
from sluice.gateway.control.demand_wake import wake_on_demand
from sluice.gateway.inference.data_plane import (
    OFFLOAD_BYTES,
    _off_loop,
    encode_reply,
    prepare,
    request_message,
)
from sluice.gateway.inference.request import RequestedOutput
from sluice.gateway.state import GatewayState
from sluice.gateway.tenants.streams import make_known

RESPOND_ASYNC = "respond-async"
_WAIT = re.compile(r"(?:^|[;,\s])wait\s*=\s*(\d{1,9})(?:$|[;,\s])", re.IGNORECASE)
_POLL_S = 0.05
_IDEMPOTENCY_KEY = re.compile(rf"[\x21-\x7e]{{1,{jobs.MAX_IDEMPOTENCY_KEY}}}")


def prefers_async(prefer: str | None) -> bool:
    """Whether a ``Prefer`` header (RFC 7240) asks for ``respond-async``."""
    if not prefer:
        return False
    return any(
        token.split(";", 1)[0].strip().lower() == RESPOND_ASYNC for token in prefer.split(",")
    )


def preferred_wait_s(prefer: str | None, limit_s: float) -> float:
    """The ``wait=N`` of a ``Prefer`` header, in seconds, within ``limit_s`` (0: none)."""
    if not prefer:
        return 0.0
    match = _WAIT.search(prefer)
    return min(float(match.group(1)), limit_s) if match else 0.0


@dataclass(frozen=True, slots=True)
class Submitted:
    job_id: str
    created: bool
    """False when an earlier job had the same idempotency key (this one is that job)."""
    status: dict[str, Any] | None = None
    """The new job's status (None for an earlier job: read it)."""


async def submit_job(
    state: GatewayState,
    model: str,
    version: str | None,
    body: bytes,
    json_length: int | None,
    *,
    label: str | None = None,
    trace: TraceParent | None = None,
    idempotency_key: str | None = None,
    owner: str = "",
) -> Submitted:
    """Validate the request as a synchronous one and queue it as a job."""
    settings = state.settings
    state.redis_room.check()
    request = await prepare(
        state,
        model,
        version,
        body,
        json_length,
        label,
        default_timeout_us=int(settings.job_queue_ttl_s * 1_000_000),
    )
    parsed = request.parsed
    if request.decoupled:
        raise Unsupported(
            f"model '{model}' is decoupled: its responses are streamed; use "
            "/generate_stream or gRPC streaming"
        )
    if request.slot is not None:
        raise InvalidInput(
            f"model '{model}' is a sequence model: its requests must be answered in order, "
            "one after the other; send them as synchronous requests"
        )
    if any(t.shm is not None for t in parsed.inputs) or any(
        o.shm is not None for o in parsed.outputs
    ):
        raise InvalidInput(
            "an asynchronous job cannot use shared memory: its tensors must outlive the "
            "request; send them in the body"
        )
    key = idempotency_key if idempotency_key is not None else (parsed.id or None)
    if key is not None and not _IDEMPOTENCY_KEY.fullmatch(key):
        raise InvalidInput(
            f"the idempotency key must be 1 to {jobs.MAX_IDEMPOTENCY_KEY} printable ASCII "
            "characters without spaces"
        )
    state.quota.check_rate(request.tenant)
    big = len(body) > OFFLOAD_BYTES
    digest = (
        await _off_loop(big, lambda: request_digest(model, version, label, json_length, body))
        if key is not None
        else ""
    )
    headers, payload, _ = await _off_loop(
        big, lambda: state.transfer.pack(parsed.inputs, local=False, inline=True)
    )
    job_id = jobs.new_job_id()
    keys = state.keys
    message = request_message(state, request, headers, trace, local=False, inline=True)
    job_key = keys.job(model, job_id)
    message.request_key, message.reply_to = job_id, job_key
    explicit_priority = "priority" in parsed.parameters
    tenant = "" if owner in ("", ANONYMOUS) else owner  # (its own stream of the level)
    stream = (
        keys.request_stream(model, request.number, request.level, tenant)
        if explicit_priority
        else keys.background_stream(model, request.number, tenant)
    )
    await make_known(state, model, request.number, stream)
    await wake_on_demand(state, model, request.number)
    outputs = [jobs.JobOutput(o.name, o.binary, o.classes) for o in parsed.outputs]
    fields = encode_request(message, payload)
    entry_bytes = sum(len(name) + len(value) for name, value in fields.items())
    if entry_bytes > settings.tenant_max_queued_job_bytes:
        raise PayloadTooLarge(
            f"the job would hold {entry_bytes} bytes in the queue, more than a tenant's "
            f"queued jobs may hold ({settings.tenant_max_queued_job_bytes} bytes, "
            "SLUICE_TENANT_MAX_QUEUED_JOB_BYTES)"
        )
    args: list[Any] = [
        job_id,
        f"{time.time():.6f}",
        int(settings.job_retention_s),
        int(settings.job_queue_ttl_s) + 1,
        settings.max_queued_jobs,
        model,
        request.number,
        jobs.encode_outputs(outputs),
        request.request_id,
        key or "",
        owner,
        parsed.id,
        digest,
        settings.tenant_max_queued_jobs,
        settings.tenant_max_queued_job_bytes,
        entry_bytes,
        settings.tenant_max_job_result_bytes,
    ]
    for name, value in fields.items():
        args += [name, value]
    script_keys = [
        job_key,
        stream,
        keys.job_by_key(model, owner, key) if key else job_key,
        keys.stats(model, request.number),
        keys.queued_jobs(model),
        keys.job_room(model),
        keys.tenant_streams(model, request.number),
        base_stream(stream),
        keys.job_results(model),
        keys.finished_jobs(model),
    ]
    # The id -> model record first: a job must never be in the queue without it. It outlives
    # the job (an hour beyond its longest life); a submission that failed on its way leaves
    # only it behind.
    await state.redis.set(keys.job_model(job_id), model, ex=args[2] + args[3] + 3600)
    outcome, found = cast(
        list[Any], await state.control.script(jobs.SUBMIT)(keys=script_keys, args=args)
    )
    if outcome != 1:
        # No job of this id (refused, or the earlier job of the key answers): its record
        # goes now, not in two days, else each refused or repeated submission would leave one.
        await state.redis.delete(keys.job_model(job_id))
    found_id = found.decode() if isinstance(found, bytes) else str(found)
    if outcome < 0:
        raise _refusal(state, outcome, model, request.number, owner, key, found_id)
    queued = {
        "id": found_id,
        "model": model,
        "version": str(request.number),
        "status": jobs.QUEUED,
        "created": _timestamp(args[1]),
        "request_id": request.request_id,
    }
    return Submitted(found_id, outcome == 1, queued if outcome == 1 else None)


def request_digest(
    model: str, version: str | None, label: str | None, json_length: int | None, body: bytes
) -> str:
    """What defines a job's request (the model, the version or label asked for, the body
    and how it splits into JSON and binary parts), as a SHA-256 in hex: kept beside the job
    id under its idempotency key, so that the key reused for another request is told apart.
    Proportional to the body: off the event loop for a large one."""
    digest = hashlib.sha256()
    digest.update(orjson.dumps([model, version or "", label or "", json_length]))
    digest.update(body)
    return digest.hexdigest()


def _refusal(
    state: GatewayState,
    outcome: int,
    model: str,
    version: int,
    owner: str,
    key: str | None,
    found: str,
) -> SluiceError:
    """The error for a refused submission (SUBMIT's negative outcomes)."""
    settings = state.settings
    if outcome == _REUSED:
        return Conflict(f"idempotency key '{key}' was used for another request")
    if outcome == _TENANT_JOBS:
        return QuotaExceeded(
            f"tenant '{owner}' has {found} jobs of model '{model}' waiting, its limit "
            f"(SLUICE_TENANT_MAX_QUEUED_JOBS={settings.tenant_max_queued_jobs}); retry later",
            5,
        )
    if outcome == _TENANT_BYTES:
        return QuotaExceeded(
            f"tenant '{owner}' has {found} bytes of jobs of model '{model}' waiting; this one "
            "would pass its limit (SLUICE_TENANT_MAX_QUEUED_JOB_BYTES="
            f"{settings.tenant_max_queued_job_bytes}); retry later",
            5,
        )
    if outcome == _TENANT_RESULTS:
        return QuotaExceeded(
            f"tenant '{owner}' keeps {found} bytes of answers of finished jobs of model "
            f"'{model}', its limit (SLUICE_TENANT_MAX_JOB_RESULT_BYTES="
            f"{settings.tenant_max_job_result_bytes}); delete finished jobs "
            "(DELETE /v2/jobs/{id}) or retry once some expire",
            60,
        )
    return Overloaded(
        f"model '{model}' version {version} has {settings.max_queued_jobs} "
        "jobs waiting, its limit; retry later",
        5,
    )


_QUEUE_FULL, _TENANT_JOBS, _REUSED, _TENANT_BYTES, _TENANT_RESULTS = -1, -2, -3, -4, -5
"""SUBMIT's refusals (see :data:`sluice.core.jobs.SUBMIT`)."""


async def job_record(state: GatewayState, job_id: str, owner: str) -> dict[str, bytes]:
    """The job's hash; NotFound for an unknown id, a finished job past its retention, or a
    job of another API key."""
    if not jobs.is_job_id(job_id):
        raise NotFound(f"no job '{job_id[:64]}'")
    model = cast(bytes | None, await state.redis.get(state.keys.job_model(job_id)))
    if model is None:
        raise NotFound(f"no job '{job_id}'")
    job_key = state.keys.job(model.decode(errors="replace"), job_id)
    raw = cast(dict[bytes, bytes], await state.redis.hgetall(job_key))
    record = {k.decode(): v for k, v in raw.items()}
    if not record or record.get(jobs.F_OWNER, b"").decode() != owner:
        raise NotFound(f"no job '{job_id}'")
    return record


def job_status(job_id: str, record: dict[str, bytes]) -> dict[str, Any]:
    """The job as ``GET /v2/jobs/{id}`` shows it."""

    def text(name: str) -> str:
        return record.get(name, b"").decode(errors="replace")

    body: dict[str, Any] = {
        "id": job_id,
        "model": text(jobs.F_MODEL),
        "version": text(jobs.F_VERSION),
        "status": text(jobs.F_STATUS),
    }
    for name in (jobs.F_CREATED, jobs.F_STARTED, jobs.F_FINISHED):
        if record.get(name):
            body[name] = _timestamp(text(name))
    if text(jobs.F_ERROR):
        body["error"] = text(jobs.F_ERROR)
    if text(jobs.F_REQUEST_ID):
        body["request_id"] = text(jobs.F_REQUEST_ID)
    return body


def _timestamp(unix: str) -> str:
    try:
        moment = datetime.datetime.fromtimestamp(float(unix), tz=datetime.UTC)
    except (ValueError, OverflowError, OSError):
        return unix
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


async def wait_for_result(
    state: GatewayState, job_id: str, owner: str, wait_s: float
) -> dict[str, bytes]:
    """The job's record once it has finished, or as it is after ``wait_s`` seconds."""
    deadline = time.monotonic() + wait_s
    while True:
        record = await job_record(state, job_id, owner)
        status = record.get(jobs.F_STATUS, b"").decode()
        if status in jobs.FINISHED or time.monotonic() >= deadline:
            return record
        await asyncio.sleep(_POLL_S)


async def encode_result(state: GatewayState, record: dict[str, bytes]) -> tuple[bytes, int | None]:
    """A completed job's answer, exactly as the synchronous request would have had it; a
    failed or expired job raises the error the synchronous request would have got."""
    status = record.get(jobs.F_STATUS, b"").decode()
    if status != jobs.COMPLETED:
        raise finished_job_error(record)
    fields = {HEADER_FIELD: record.get(jobs.F_REPLY, b""), DATA_FIELD: record.get(jobs.F_DATA, b"")}
    reply, data = decode_reply(fields)
    wanted = [
        RequestedOutput(o.name, o.binary, classes=o.classes)
        for o in jobs.decode_outputs(record.get(jobs.F_OUTPUTS, b"\x90"))
    ]
    model = record.get(jobs.F_MODEL, b"").decode()
    client_id = record.get(jobs.F_CLIENT_ID, b"").decode(errors="replace")
    return await _off_loop(
        len(data) > OFFLOAD_BYTES,
        lambda: encode_reply(state.transfer, model, reply, data, wanted, client_id),
    )


def finished_job_error(record: dict[str, bytes]) -> SluiceError:
    """The error a failed or expired job keeps, with its status code; never with
    ``Retry-After``, even when it is a refusal (a 429 naming the tenant's
    SLUICE_TENANT_MAX_JOB_RESULT_BYTES, an answer that was not kept): the job is over, and
    reading its result again answers the same. Submit it again instead."""
    status = record.get(jobs.F_STATUS, b"").decode()
    kind = record.get(jobs.F_ERROR_KIND, b"").decode()
    message = record.get(jobs.F_ERROR, b"").decode(errors="replace")
    error = error_from_kind(kind or "InferenceFailed", message or f"the job {status}")
    if isinstance(error, Overloaded):
        error.retry_after_s = None
    return error


async def cancel_job(state: GatewayState, job_id: str, owner: str) -> str:
    """Cancel the job; its status afterwards."""
    record = await job_record(state, job_id, owner)
    stream = record.get(jobs.F_STREAM, b"").decode()
    model = record.get(jobs.F_MODEL, b"").decode()
    stats = state.keys.stats(model, int(record.get(jobs.F_VERSION, b"0") or 0))
    job_key = state.keys.job(model, job_id)
    try:
        now = f"{time.time():.6f}"
        status = await state.redis.eval(
            jobs.CANCEL,
            5,
            job_key,
            stream,
            stats,
            state.keys.queued_jobs(model),
            state.keys.job_room(model),
            now,
            job_id,
        )
    except RedisError as exc:
        raise SluiceError(f"cannot cancel job '{job_id}': {exc}") from None
    if status is None:
        raise NotFound(f"no job '{job_id}'")
    text = status.decode() if isinstance(status, bytes) else str(status)
    if text == jobs.CANCELLING:
        # A worker holds it: if it has not computed it yet, it drops it (and settles the
        # job as cancelled); else its answer settles it.
        with contextlib.suppress(RedisError):
            await state.redis.xadd(
                state.keys.cancellations(model),
                notice_fields(job_key, job_id),  # type: ignore[arg-type]
                maxlen=NOTICES_MAX_LEN,
                approximate=True,
            )
    return text


async def remove_finished_job(
    state: GatewayState, job_id: str, owner: str, record: dict[str, bytes]
) -> None:
    """Delete the job (``record``: its hash, as :func:`job_record` found it for ``owner``)
    with its answer if it has finished (what the answer held in its tenant's account is
    given back); a job still waiting or computing is left as it is."""
    model = record.get(jobs.F_MODEL, b"").decode()
    key = record.get(jobs.F_KEY, b"").decode()
    job_key = state.keys.job(model, job_id)
    keys = state.keys
    try:
        await state.redis.eval(
            jobs.REMOVE,
            4,
            job_key,
            keys.job_by_key(model, owner, key) if key else job_key,
            keys.job_results(model),
            keys.finished_jobs(model),
            job_id,
        )
    except RedisError as exc:
        raise SluiceError(f"cannot delete job '{job_id}': {exc}") from None


def status_body(job_id: str, record: dict[str, bytes]) -> bytes:
    return orjson.dumps(job_status(job_id, record))
