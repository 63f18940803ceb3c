"""The job routes (see :mod:`sluice.gateway.jobs.async_jobs`):

- ``GET /v2/jobs/{id}``: status and timestamps (and the error of a failed job);
- ``GET /v2/jobs/{id}/result``: the answer, exactly as the synchronous request would have
  had it (JSON or binary tensors; a failed job's error with its status code). While the job
  is not finished: 202 with its status and ``Retry-After``; ``Prefer: wait=N`` holds the
  request up to N seconds (at most ``SLUICE_MAX_JOB_WAIT_S``) for it to finish;
- ``DELETE /v2/jobs/{id}``: cancel it (202 while a worker still holds it, then
  ``cancelled``); a finished job is deleted with its answer (200 with its last status; it
  is not found afterwards), which gives back what the answer held of its tenant's room.

A job is found only by the tenant whose key submitted it.
"""

from __future__ import annotations

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response

from sluice.core import jobs
from sluice.gateway.http.guard import tenant_of
from sluice.gateway.http.json_body import json_response
from sluice.gateway.http.protocol import cancel_on_disconnect
from sluice.gateway.jobs.async_jobs import (
    cancel_job,
    encode_result,
    job_record,
    job_status,
    preferred_wait_s,
    remove_finished_job,
    status_body,
    wait_for_result,
)
from sluice.gateway.state import state_of

job_router = APIRouter()


@job_router.get("/v2/jobs/{job_id}")
async def get_job(job_id: str, request: Request) -> Response:
    state = state_of(request)
    record = await job_record(state, job_id, tenant_of(request.scope))
    return Response(status_body(job_id, record), media_type="application/json")


@job_router.get("/v2/jobs/{job_id}/result")
async def get_result(job_id: str, request: Request) -> Response:
    state = state_of(request)
    owner = tenant_of(request.scope)
    wait_s = preferred_wait_s(request.headers.get("prefer"), state.settings.max_job_wait_s)
    if wait_s:
        # A client gone while it waits stops the polling for it (else each connection
        # opened and dropped would leave a poller of Redis for up to SLUICE_MAX_JOB_WAIT_S).
        cancel_on_disconnect(request.scope)
    record = await wait_for_result(state, job_id, owner, wait_s)
    status = record.get(jobs.F_STATUS, b"").decode()
    if status == jobs.CANCELLED:
        body = {"error": f"job '{job_id}' was cancelled", **job_status(job_id, record)}
        return json_response(body, 410)
    if status not in jobs.FINISHED:
        answer = Response(status_body(job_id, record), 202, media_type="application/json")
        answer.headers["Retry-After"] = "1"
        return answer
    return inference_response(*await encode_result(state, record))


@job_router.delete("/v2/jobs/{job_id}")
async def delete_job(job_id: str, request: Request) -> Response:
    state = state_of(request)
    owner = tenant_of(request.scope)
    before = await job_record(state, job_id, owner)
    if before.get(jobs.F_STATUS, b"").decode() in jobs.FINISHED:
        await remove_finished_job(state, job_id, owner, before)
        return Response(status_body(job_id, before), 200, media_type="application/json")
    await cancel_job(state, job_id, owner)
    record = await job_record(state, job_id, owner)
    status = record.get(jobs.F_STATUS, b"").decode()
    return Response(
        status_body(job_id, record),
        200 if status in jobs.FINISHED else 202,
        media_type="application/json",
    )


def inference_response(content: bytes, json_length: int | None) -> Response:
    """An inference answer: JSON, or JSON and binary tensors (``json_length`` given)."""
    if json_length is None:
        return Response(content, media_type="application/json")
    return Response(
        content,
        media_type="application/octet-stream",
        headers={"Inference-Header-Content-Length": str(json_length)},
    )
