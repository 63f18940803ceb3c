"""Offline batch jobs over HTTP (see :mod:`sluice.batches`):

- ``POST /v2/batches`` ``{"model", "input", "output", "version"?, "options"?}``: 201, the
  job's status, and its URL in ``Location``; the request is checked field by field (400
  naming the field), the model must be served;
- ``GET /v2/batches/{id}``: status, rows done of the total, rate, ETA, shards, each failed
  shard's error, and the manifest once complete;
- ``POST /v2/batches/{id}/cancel``, ``POST /v2/batches/{id}/resume``;
- ``GET /v2/batches``: the newest 100 of this API key.

The gateway only writes the record and queues the planning task (Celery, on the same
Redis); batch workers do the rest. Like a job, a batch job is found only with the API key
that submitted it.
"""

from __future__ import annotations

import asyncio
import json
import time
from functools import cache
from typing import Any, cast

import orjson
from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response

from gateway.guard import tenant_of
from gateway.json_body import json_object, json_response
from gateway.state import GatewayState, state_of
from sluice import batches as b
from sluice.celery_config import broker_url, celery_app, queue_name
from sluice.errors import InvalidInput, NotFound, Unsupported

batch_router = APIRouter()

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
    settings = state.settings
    app = _celery_of(state)
    await asyncio.to_thread(
        app.send_task,
        b.PLAN_TASK,
        args=[batch_id, resume],
        queue=queue_name(settings.namespace),
    )


@batch_router.post("/v2/batches")
async def submit(request: Request) -> Response:
    state = state_of(request)
    _celery_of(state)  # refused before anything is written
    body = b.parse_batch_request(json_object(await request.body()))
    entry = state.view.entry(body.model)  # 404 for an unknown model
    if body.version is not None and body.version not in entry.versions:
        raise InvalidInput(f"'version': model '{body.model}' does not serve version {body.version}")
    batch_id = b.new_batch_id()
    tenant = tenant_of(request.scope)
    now = time.time()
    keys = state.keys
    async with state.redis.pipeline(transaction=False) as pipe:
        pipe.hset(
            keys.batch(batch_id),
            mapping={
                b.F_STATUS: b.PLANNING,
                b.F_MODEL: body.model,
                b.F_VERSION: body.version or "",
                b.F_INPUT: body.input,
                b.F_OUTPUT: body.output,
                b.F_OPTIONS: orjson.dumps(body.options.to_json()),
                b.F_CREATED: f"{now:.6f}",
                b.F_OWNER: tenant,
            },
        )
        pipe.zadd(keys.batches(tenant), {batch_id: now})
        await pipe.execute()
    await _queue_plan(state, batch_id, resume=False)
    answer = json_response(await _status(state, batch_id, request), 201)
    answer.headers["Location"] = f"/v2/batches/{batch_id}"
    return answer


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
    record = await _record(state, batch_id, request)
    if record.get(b.F_STATUS) not in b.FINISHED:
        async with state.redis.pipeline(transaction=False) as pipe:
            pipe.hset(
                state.keys.batch(batch_id),
                mapping={b.F_STATUS: b.CANCELLED, b.F_FINISHED: f"{time.time():.6f}"},
            )
            pipe.srem(state.keys.running_batches, batch_id)
            await pipe.execute()
    return json_response(await _status(state, batch_id, request))


@batch_router.post("/v2/batches/{batch_id}/resume")
async def resume(batch_id: str, request: Request) -> Response:
    state = state_of(request)
    record = await _record(state, batch_id, request)
    status = record.get(b.F_STATUS)
    if status == b.COMPLETED:
        raise InvalidInput(f"batch '{batch_id}' is complete; there is nothing to resume")
    planned = bool(record.get(b.F_SHARDS))
    async with state.redis.pipeline(transaction=False) as pipe:
        pipe.hset(
            state.keys.batch(batch_id),
            mapping={
                b.F_STATUS: b.RUNNING if planned else b.PLANNING,
                b.F_ERROR: "",
                b.F_FINISHED: "",
            },
        )
        if planned:
            pipe.sadd(state.keys.running_batches, batch_id)
        await pipe.execute()
    await _queue_plan(state, batch_id, resume=True)
    return json_response(await _status(state, batch_id, request))


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
        "output": record.get(b.F_OUTPUT, ""),
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
    done = min(total, sum(int(v) for v in progress)) if total else 0
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
    errors = []
    for index, raw in sorted(shards.items(), key=lambda kv: int(kv[0])):
        if b'"error"' in raw:
            errors.append({"shard": int(index), "error": orjson.loads(raw)["error"]})
    if errors:
        body["errors"] = errors[:_ERRORS_SHOWN]
    if record.get(b.F_ERROR):
        body["error"] = record[b.F_ERROR]
    if record.get(b.F_MANIFEST):
        body["manifest"] = record[b.F_MANIFEST]
    return body
