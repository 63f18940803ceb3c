"""Offline batch jobs over HTTP (see :mod:`sluice.core.batch_jobs.batches`):

- ``POST /v2/batches`` ``{"model", "input", "output"?, "version"?, "options"?}``: 201, the
  job's status, and its URL in ``Location``; the request is checked field by field (400
  naming the field), the model must be served. ``input`` is ``upload:<id>`` (one of the
  tenant's uploads) or a location the operator allows the tenant (403 otherwise, see
  :mod:`sluice.core.batch_jobs.access`); ``output`` left out: the batch store. A tenant keeps
  at most ``SLUICE_TENANT_MAX_BATCHES`` jobs (429), and a job writing to the batch store
  is refused (429) while its tenant keeps ``SLUICE_TENANT_MAX_STORED_BYTES`` there; a job
  the broker cannot take is 503, and nothing of it stays. While the tenant has
  ``SLUICE_TENANT_MAX_RUNNING_BATCHES`` jobs running, a new one waits ``queued`` in line
  (:mod:`sluice.core.batch_jobs.turns`) and starts as one of them ends;
- ``GET /v2/batches/{id}``: status, rows done of the total, rate, ETA, shards, each failed
  shard's error, the manifest once complete, and a waiting job's ``place`` in line;
- ``POST /v2/batches/{id}/cancel``, ``POST /v2/batches/{id}/resume`` (each one script on the
  record: one that lands as the job completes leaves it completed; a resume that would
  write to a full store is 429 as a new job is; a resume while an earlier one still waits
  for a batch worker queues nothing more, and is answered as that one will be; a job that
  had ended waits for a turn as a new one does; a resume of a job waiting in line changes
  nothing);
- ``DELETE /v2/batches/{id}``: a job that has ended, or waits in line, goes now, with its
  outputs in the store (their bytes given back to the tenant's quota); 409 while it runs;
- ``GET /v2/batches``: the tenant's newest 100;
- ``GET /v2/batches/{id}/outputs``: the files of a completed batch, or those of the shards
  a failed or cancelled one committed, each with its rows (409 while it runs), and
  ``GET /v2/batches/{id}/outputs/{name}``: one of them, streamed.

The gateway only writes the record and queues the planning task (Celery, on the same
Redis); batch workers do the rest. A batch job belongs to its tenant: another tenant's is
answered exactly as an unknown one (404).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Iterator
from functools import cache
from typing import Any, cast

import orjson
from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from sluice.core.batch_jobs import batches as b
from sluice.core.batch_jobs import output_quota as oq
from sluice.core.batch_jobs import turns
from sluice.core.batch_jobs import uploads as u
from sluice.core.batch_jobs.celery_config import broker_url, celery_app, queue_name
from sluice.core.batch_jobs.store import Tree, open_tree
from sluice.core.clock import CLOCK
from sluice.core.errors import (
    Conflict,
    InvalidInput,
    NotFound,
    Overloaded,
    QuotaExceeded,
    Unsupported,
)
from sluice.gateway.http.guard import tenant_of
from sluice.gateway.http.json_body import json_object, json_response
from sluice.gateway.jobs.store_sweep import store_sweeper
from sluice.gateway.jobs.upload_routes import batch_data, quota_message, upload_record
from sluice.gateway.state import GatewayState, state_of

batch_router = APIRouter()
log = logging.getLogger("gateway")

_ERRORS_SHOWN = 20


@cache
def _celery(redis_url: str, namespace: str) -> Any:
    """The Celery app that sends plan tasks; None without the batch extra."""
    try:
        return celery_app(redis_url, namespace)
    except ImportError:
        return None


def _celery_of(state: GatewayState) -> Any:
    """The Celery app, or Unsupported saying what is missing."""
    settings = state.settings
    try:
        broker = broker_url(settings.redis_url, settings.batch_broker_url)
    except ValueError as exc:
        raise Unsupported(str(exc)) from None
    app = _celery(broker, settings.namespace)
    if app is None:
        raise Unsupported("batch jobs need Celery: pip install 'sluice[batch]'")
    return app


async def _queue_plan(state: GatewayState, batch_id: str, resume: bool) -> None:
    """Hand the job's planning task to the batch workers' queue; 503 naming the reason when
    the broker cannot take it."""
    settings = state.settings
    app = _celery_of(state)
    try:
        await asyncio.to_thread(
            app.send_task,
            b.PLAN_TASK,
            args=[batch_id, resume],
            queue=queue_name(settings.namespace),
        )
    except Exception as exc:  # kombu's OperationalError (and what a transport raises)
        log.warning("queueing batch %s failed: %s", batch_id, exc)
        raise Overloaded(
            f"the batch job could not be queued (its broker is out of reach: {str(exc)[:200]}); "
            "retry later",
            _QUEUE_RETRY_S,
        ) from None


_QUEUE_RETRY_S = 5


def _turns(state: GatewayState) -> turns.Turns:
    """The tenants' turns as this gateway gives them on (a job it cancels or deletes), with
    a blocking client: its calls run on a thread."""
    settings = state.settings

    def send_plan(batch_id: str) -> None:
        _celery_of(state).send_task(
            b.PLAN_TASK, args=[batch_id, True], queue=queue_name(settings.namespace)
        )

    client = store_sweeper(state).redis  # (the gateway's blocking client; it may connect)
    return turns.Turns(client, state.keys, settings.tenant_max_running_batches, send_plan)


async def _take_turn(state: GatewayState, tenant: str, batch_id: str) -> bool:
    """Give the ``queued`` job a turn of its tenant's, or put it in line (where it waits
    until one of the tenant's running jobs ends); True when it got one and started: the
    caller queues its plan task (resuming it)."""
    keys, now = state.keys, f"{CLOCK.now():.3f}"
    admit = state.control.script(turns.ADMIT)
    limit = state.settings.tenant_max_running_batches
    place = await admit(keys=turns.tenant_keys(keys, tenant), args=[batch_id, limit, tenant, now])
    if int(place):
        return False
    start = state.control.script(turns.START)
    before, send = await start(keys=[keys.batch(batch_id)], args=[now, b.RESUME_QUEUED_S])
    return bool(before == b.QUEUED.encode() and send)


async def _intend(state: GatewayState, tenant: str, batch_id: str) -> str:
    """Say, in the turns' slot, that the job is about to be made ``queued`` here and then
    admitted (:data:`turns.INTEND`): were this process to stop in between, the batch
    workers' periodic round admits it. When it was written (the caller's
    :func:`_not_coming`)."""
    now = f"{CLOCK.now():.3f}"
    intend = state.control.script(turns.INTEND)
    await intend(keys=turns.tenant_keys(state.keys, tenant), args=[batch_id, tenant, now])
    return now


async def _not_coming(state: GatewayState, tenant: str, batch_id: str, since: str) -> None:
    """The job was not made ``queued`` after all: the entry of :func:`_intend` goes (best
    effort: the periodic round drops it later otherwise)."""
    try:
        lapse = state.control.script(turns.LAPSE)
        await lapse(keys=turns.tenant_keys(state.keys, tenant), args=[tenant, batch_id, since])
    except Exception as exc:
        log.warning(
            "batch %s: dropping its way in failed (the batch workers do): %s", batch_id, exc
        )


async def _give_turn(state: GatewayState, tenant: str, batch_id: str) -> None:
    """The job ended here (cancelled, deleted, or not queued after all): its turn goes to
    the tenant's next job in line, which starts (best effort: the batch workers' periodic
    round does it otherwise)."""
    try:
        leave = (await asyncio.to_thread(_turns, state)).leave
        await asyncio.to_thread(leave, tenant, batch_id)
    except Exception as exc:
        log.warning("batch %s: giving its turn on failed (the batch workers do): %s", batch_id, exc)


@batch_router.post("/v2/batches")
async def submit(request: Request) -> Response:
    state = state_of(request)
    _celery_of(state)  # refused before anything is written
    state.redis_room.check()
    document = json_object(await request.body())
    tenant = tenant_of(request.scope)
    keys = state.keys
    data = batch_data(state)
    source = document.get("input")
    upload_name = ""
    if isinstance(source, str) and b.is_upload_input(source):
        b.check_location(source, "input")
        upload_name = (await upload_record(state, tenant, b.upload_of(source)))[u.F_NAME]
    body = b.parse_batch_request(document, upload_name)
    entry = state.view.entry(body.model)  # 404 for an unknown model
    if body.version is not None and body.version not in entry.versions:
        raise InvalidInput(f"'version': model '{body.model}' does not serve version {body.version}")
    if entry.config is not None:
        b.check_input_name(body.options, body.model, [spec.name for spec in entry.config.inputs])
    if not upload_name:
        await asyncio.to_thread(data.policy.check, tenant, body.input, "input")
    if body.output:
        await asyncio.to_thread(data.policy.check, tenant, body.output, "output")
    else:
        data.need_store()
        await _check_room(state, tenant)
    batch_id = b.new_batch_id()
    now = time.time()
    add = state.control.script(b.ADD)
    limit = state.settings.tenant_max_batches
    if not int(await add(keys=[keys.batches(tenant)], args=[batch_id, f"{now:.6f}", limit])):
        raise QuotaExceeded(
            f"this tenant keeps {limit} batch jobs, as many as SLUICE_TENANT_MAX_BATCHES "
            "allows: retry once old ones expire (SLUICE_BATCH_RETENTION_S after they end)",
            _BATCHES_RETRY_S,
        )
    used = False
    try:
        if upload_name:
            upload_id = b.upload_of(body.input)
            use = state.control.script(u.USE)
            member = u.expiry_member(u.UPLOAD, tenant, upload_id)
            used = bool(
                int(
                    await use(
                        keys=[keys.upload(tenant, upload_id), keys.store_expiry], args=[member]
                    )
                )
            )
            if not used:
                raise NotFound(f"no upload '{upload_id}'")
        await _intend(state, tenant, batch_id)  # (before the record: see turns)
        await state.redis.hset(
            keys.batch(batch_id),
            mapping={
                b.F_STATUS: b.QUEUED,
                b.F_MODEL: body.model,
                b.F_VERSION: body.version or "",
                b.F_INPUT: body.input,
                b.F_OUTPUT: body.output,
                b.F_OPTIONS: orjson.dumps(body.options.to_json()),
                b.F_CREATED: f"{now:.6f}",
                b.F_OWNER: tenant,
            },
        )
        if await _take_turn(state, tenant, batch_id):
            await _queue_plan(state, batch_id, resume=True)
    except BaseException:
        # Nothing stays of a job that was not queued: no record left planning for ever,
        # no upload held by it (it could neither expire nor be deleted), no room taken.
        await _undo(state, tenant, batch_id, body.input if used else "")
        raise
    answer = json_response(await _status(state, batch_id, request), 201)
    answer.headers["Location"] = f"/v2/batches/{batch_id}"
    return answer


_BATCHES_RETRY_S = 3600
_QUOTA_RETRY_S = 60


async def _check_room(state: GatewayState, tenant: str) -> None:
    """429 naming the quota when ``tenant`` keeps as many bytes in the batch store as
    SLUICE_TENANT_MAX_STORED_BYTES allows (its uploads and its batch jobs' outputs): a job
    that would write there is refused before it runs."""
    quota = state.settings.tenant_max_stored_bytes
    stored = int(cast(bytes | None, await state.redis.get(state.keys.stored_bytes(tenant))) or 0)
    if stored >= quota:
        raise QuotaExceeded(quota_message(quota), _QUOTA_RETRY_S)


async def _undo(state: GatewayState, tenant: str, batch_id: str, upload_input: str) -> None:
    """Forget a batch job whose submission failed, and give back the upload it took."""
    keys = state.keys
    try:
        await state.redis.delete(keys.batch(batch_id))
        await _give_turn(state, tenant, batch_id)
        release = state.control.script(oq.RELEASE)
        await release(keys=oq.quota_keys(keys, tenant), args=[batch_id, 0])
        if upload_input:
            upload_id = b.upload_of(upload_input)
            await state.redis.eval(
                u.RELEASE,
                2,
                keys.upload(tenant, upload_id),
                keys.store_expiry,
                u.expiry_member(u.UPLOAD, tenant, upload_id),
                repr(time.time()),
            )
    except Exception as exc:  # Redis gone too: what is left is the job's planning record
        log.warning("forgetting batch %s that was not queued failed: %s", batch_id, exc)


@batch_router.get("/v2/batches")
async def list_batches(request: Request) -> Response:
    state = state_of(request)
    owner = tenant_of(request.scope)
    ids = cast(
        list[bytes], await state.redis.zrevrange(state.keys.batches(owner), 0, b.MAX_LISTED - 1)
    )
    async with state.redis.pipeline(transaction=False) as pipe:
        for raw in ids:
            pipe.hgetall(state.keys.batch(raw.decode()))
        records = cast(list[dict[bytes, bytes]], await pipe.execute())
    listed = []
    for raw, record in zip(ids, records, strict=True):
        fields = _decoded(record)
        if fields and fields.get(b.F_OWNER, "") == owner:
            listed.append(_summary(raw.decode(), fields))
    return json_response({"batches": listed})


@batch_router.get("/v2/batches/{batch_id}")
async def get_batch(batch_id: str, request: Request) -> Response:
    return json_response(await _status(state_of(request), batch_id, request))


@batch_router.post("/v2/batches/{batch_id}/cancel")
async def cancel(batch_id: str, request: Request) -> Response:
    state = state_of(request)
    await _record(state, batch_id, request)
    now = time.time()
    cancelled = await state.redis.eval(b.CANCEL, 1, state.keys.batch(batch_id), f"{now:.6f}")
    if cancelled == b.CANCELLED.encode():
        member = u.expiry_member(u.BATCH, tenant_of(request.scope), batch_id)
        async with state.redis.pipeline(transaction=False) as pipe:
            pipe.srem(state.keys.running_batches, batch_id)
            pipe.zadd(state.keys.store_expiry, {member: now + state.settings.batch_retention_s})
            await pipe.execute()
        await _give_turn(state, tenant_of(request.scope), batch_id)
    return json_response(await _status(state, batch_id, request))


@batch_router.post("/v2/batches/{batch_id}/resume")
async def resume(batch_id: str, request: Request) -> Response:
    state = state_of(request)
    state.redis_room.check()
    record = await _record(state, batch_id, request)
    if not record.get(b.F_OUTPUT) and record.get(b.F_STATUS) in (b.FAILED, b.CANCELLED):
        await _check_room(state, tenant_of(request.scope))
    keys = state.keys
    tenant = tenant_of(request.scope)
    member = u.expiry_member(u.BATCH, tenant, batch_id)
    # A job that had ended becomes queued: its way into the turns is written first, so that
    # the periodic round admits it were this process to stop before it does.
    since = await _intend(state, tenant, batch_id)
    answer = cast(
        list[bytes | int],
        await state.redis.eval(
            b.RESUME, 1, keys.batch(batch_id), f"{CLOCK.now():.6f}", b.RESUME_QUEUED_S
        ),
    )
    if not answer or answer[1] != b.QUEUED.encode():
        await _not_coming(state, tenant, batch_id, since)
    if not answer:
        raise NotFound(f"no batch '{batch_id}'")  # (it expired meanwhile)
    before, resumed = (cast(bytes, status).decode() for status in answer[:2])
    if resumed == b.COMPLETED:
        raise InvalidInput(f"batch '{batch_id}' is complete; there is nothing to resume")
    async with state.redis.pipeline(transaction=False) as pipe:
        if resumed == b.RUNNING:
            pipe.sadd(keys.running_batches, batch_id)
        pipe.zrem(keys.store_expiry, member)
        await pipe.execute()
    if resumed == b.QUEUED:
        # It had ended: it waits for a turn as a new job does. One waiting already keeps
        # its place.
        if not await _take_turn(state, tenant, batch_id):
            return json_response(await _status(state, batch_id, request))
    elif not answer[2]:
        # A resume queued before waits for a batch worker: it resumes the job as it is
        # when it runs, so this one is answered as it will be, and queues nothing more.
        return json_response(await _status(state, batch_id, request))
    try:
        await _queue_plan(state, batch_id, resume=True)
    except Overloaded as exc:
        if before == b.QUEUED:
            # It waited in line and started here: its plan task counts as lost, so that
            # the batch workers' periodic round queues it again.
            await state.redis.hset(keys.batch(batch_id), b.F_RESUME_QUEUED, "1")
            raise
        await state.redis.hdel(keys.batch(batch_id), b.F_RESUME_QUEUED)  # (nothing waits)
        if before not in b.FINISHED:
            raise  # (it runs on as it did)
        # Ended again (failed, with the reason), so that it still expires.
        now = time.time()
        ended = await state.redis.eval(
            b.END,
            1,
            keys.batch(batch_id),
            b.F_STATUS,
            b.FAILED,
            b.F_ERROR,
            exc.message,
            b.F_FINISHED,
            f"{now:.6f}",
        )
        if ended:
            async with state.redis.pipeline(transaction=False) as pipe:
                pipe.srem(keys.running_batches, batch_id)
                pipe.zadd(keys.store_expiry, {member: now + state.settings.batch_retention_s})
                await pipe.execute()
            await _give_turn(state, tenant, batch_id)
        raise
    return json_response(await _status(state, batch_id, request))


@batch_router.delete("/v2/batches/{batch_id}")
async def delete_batch(batch_id: str, request: Request) -> Response:
    state = state_of(request)
    record = await _record(state, batch_id, request)
    status = record.get(b.F_STATUS, "")
    tenant = tenant_of(request.scope)
    if status == b.QUEUED:
        # Out of line first (cancelled), so that no batch worker starts it as it goes.
        withdraw = state.control.script(turns.WITHDRAW)
        if int(await withdraw(keys=[state.keys.batch(batch_id)], args=[f"{time.time():.6f}"])):
            await _give_turn(state, tenant, batch_id)
        record = await _record(state, batch_id, request)
        status = record.get(b.F_STATUS, "")
    if status not in b.FINISHED:
        raise Conflict(
            f"batch '{batch_id}' is {status}: cancel it first "
            f"(POST /v2/batches/{batch_id}/cancel), then delete it"
        )
    sweeper = await asyncio.to_thread(store_sweeper, state)  # (its client may connect)
    if not await asyncio.to_thread(sweeper.remove_batch, tenant, batch_id, record):
        raise NotFound(f"no batch '{batch_id}'")  # (removed meanwhile)
    return Response(status_code=204)


async def _record(state: GatewayState, batch_id: str, request: Request) -> dict[str, str]:
    if not b.is_batch_id(batch_id):
        raise NotFound(f"no batch '{batch_id[:64]}'")
    record = _decoded(
        cast(dict[bytes, bytes], await state.redis.hgetall(state.keys.batch(batch_id)))
    )
    if not record or record.get(b.F_OWNER, "") != tenant_of(request.scope):
        raise NotFound(f"no batch '{batch_id}'")
    return record


def _decoded(record: dict[bytes, bytes]) -> dict[str, str]:
    return {k.decode(): v.decode(errors="replace") for k, v in record.items()}


def _summary(batch_id: str, record: dict[str, str]) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": batch_id,
        "model": record.get(b.F_MODEL, ""),
        "status": record.get(b.F_STATUS, ""),
        "input": record.get(b.F_INPUT, ""),
        "output": record.get(b.F_OUTPUT) or None,
        "created": _number(record.get(b.F_CREATED)),
    }
    if record.get(b.F_VERSION):
        body["version"] = int(record[b.F_VERSION])
    return body


def _number(value: str | None) -> float | None:
    try:
        return round(float(value), 3) if value else None
    except ValueError:
        return None


async def _status(state: GatewayState, batch_id: str, request: Request) -> dict[str, Any]:
    record = await _record(state, batch_id, request)
    keys = state.keys
    async with state.redis.pipeline(transaction=False) as pipe:
        pipe.hvals(keys.batch_progress(batch_id))
        pipe.hgetall(keys.batch_shards(batch_id))
        progress, shards = await pipe.execute()
    body = _summary(batch_id, record)
    total = int(record.get(b.F_ROWS_TOTAL) or 0)
    # (A batch may have up to MAX_SHARDS shards, as many as the client's shard_rows makes.)
    rows, shard_errors = await asyncio.to_thread(_shard_summary, progress, shards)
    done = min(total, rows) if total else 0
    started, finished = _number(record.get(b.F_STARTED)), _number(record.get(b.F_FINISHED))
    body.update(
        rows_total=total,
        rows_done=done,
        started=started,
        finished=finished,
        options=json.loads(record.get(b.F_OPTIONS) or "{}"),
        shards={
            "total": int(record.get(b.F_SHARDS) or 0),
            "done": int(record.get(b.F_SHARDS_DONE) or 0),
            "failed": int(record.get(b.F_SHARDS_FAILED) or 0),
        },
    )
    if started:
        elapsed = (finished or time.time()) - started
        rate = done / elapsed if elapsed > 0 else 0.0
        body["rows_per_s"] = round(rate, 1)
        if rate > 0 and body["status"] == b.RUNNING:
            body["eta_s"] = round((total - done) / rate, 1)
    body.update(shard_errors)
    if body["status"] == b.QUEUED:
        # Its place in its tenant's line (1: next); none while it is being started.
        line = keys.tenant_queued_batches(record.get(b.F_OWNER, ""))
        rank = cast(int | None, await state.redis.zrank(line, batch_id))
        if rank is not None:
            body["place"] = rank + 1
    if record.get(b.F_ERROR):
        body["error"] = record[b.F_ERROR]
    if record.get(b.F_MANIFEST):
        body["manifest"] = record[b.F_MANIFEST]
    return body


def _shard_summary(progress: list[bytes], shards: dict[bytes, bytes]) -> tuple[int, dict[str, Any]]:
    """The rows the shards have done (``progress``: each one's count) and what failed: the
    first failed shards' errors, the rows that failed in committed shards and the first
    of their errors. Proportional to the shards: the caller runs it on a thread."""
    errors: list[dict[str, Any]] = []
    rows_failed = 0
    row_errors: list[dict[str, Any]] = []
    for index, raw in sorted(shards.items(), key=lambda kv: int(kv[0])):
        if b'"error"' in raw:
            if len(errors) < _ERRORS_SHOWN:
                errors.append({"shard": int(index), "error": orjson.loads(raw)["error"]})
        elif b'"rows_failed":0' not in raw and b'"rows_failed"' in raw:
            committed = orjson.loads(raw)  # (a shard some of whose rows failed)
            rows_failed += int(committed["rows_failed"])
            row_errors += committed.get("row_errors", [])[: _ERRORS_SHOWN - len(row_errors)]
    found: dict[str, Any] = {}
    if errors:
        found["errors"] = errors
    if rows_failed:
        found["rows_failed"] = rows_failed
        found["row_errors"] = row_errors
    return sum(int(v) for v in progress), found


@batch_router.get("/v2/batches/{batch_id}/outputs")
async def list_outputs(batch_id: str, request: Request) -> Response:
    state = state_of(request)
    record = await _record(state, batch_id, request)
    return json_response({"files": await _files(state, batch_id, record)})


@batch_router.get("/v2/batches/{batch_id}/outputs/{name}")
async def download_output(batch_id: str, name: str, request: Request) -> Response:
    state = state_of(request)
    record = await _record(state, batch_id, request)
    listed = {f["name"]: f for f in await _files(state, batch_id, record)}
    if name not in listed:  # the client's text names a listed file, never a path
        raise NotFound(f"batch '{batch_id}' has no output file '{name[:100]}'")
    tree = await asyncio.to_thread(_output_tree, state, record, batch_id)
    size = await asyncio.to_thread(tree.size, name)
    if size is None:
        raise NotFound(f"{tree.join(name)} is gone")
    chunks = await asyncio.to_thread(tree.read_chunks, name, size)
    return StreamingResponse(
        _streamed(chunks),
        media_type="application/octet-stream",
        headers={
            "Content-Length": str(size),
            "Content-Disposition": f'attachment; filename="{name}"',
        },
    )


async def _files(
    state: GatewayState, batch_id: str, record: dict[str, str]
) -> list[dict[str, Any]]:
    """The files of a batch that ended: all of a completed one's, or the parts of the shards
    a failed or cancelled one committed (what it answered is never lost: resume it for the
    rest); 409 (saying why) while it runs."""
    status = record.get(b.F_STATUS, "")
    if status == b.COMPLETED and record.get(b.F_FILES):
        files: list[dict[str, Any]] = json.loads(record[b.F_FILES])
        return files
    if status not in b.FINISHED:
        raise Conflict(
            f"batch '{batch_id}' is {status or 'unknown'}: its outputs are listed once it has ended"
        )
    states = cast(dict[bytes, bytes], await state.redis.hgetall(state.keys.batch_shards(batch_id)))
    return await asyncio.to_thread(_committed_parts, states)


def _committed_parts(states: dict[bytes, bytes]) -> list[dict[str, Any]]:
    """The part files of the committed shards among ``states`` (a batch's shard states), in
    input order, each with its size and the rows it holds (``[start, end)``)."""
    parts = []
    for _, raw in sorted(states.items(), key=lambda kv: int(kv[0])):
        if b'"committed"' not in raw:
            continue
        shard = orjson.loads(raw)
        for name, size in sorted(shard.get("sizes", {}).items()):
            parts.append({"name": name, "bytes": size, "rows": shard["rows"]})
    return parts


def _output_tree(state: GatewayState, record: dict[str, str], batch_id: str) -> Tree:
    data = batch_data(state)
    tenant = record.get(b.F_OWNER, "")
    output = record.get(b.F_OUTPUT, "")
    if not output:
        return data.need_store().batch_outputs(tenant, batch_id)
    real = data.policy.check(tenant, output, "output")
    return open_tree(real, data.clients, output).child(batch_id, f"{output.rstrip('/')}/{batch_id}")


async def _streamed(chunks: Iterator[bytes]) -> AsyncIterator[bytes]:
    """The file's pieces, each read on a thread (never on the event loop)."""
    try:
        while True:
            piece = await asyncio.to_thread(next, chunks, None)
            if piece is None:
                return
            yield piece
    finally:
        close = getattr(chunks, "close", None)
        if close is not None:
            await asyncio.to_thread(close)
