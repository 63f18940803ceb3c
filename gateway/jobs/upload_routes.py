"""Uploads: a tenant's data for its batch jobs, sent through the gateway into the batch
store (see :mod:`sluice.core.batch_jobs.uploads`):

- ``POST /v2/uploads?name=<file name>``: the body is the file, streamed to the store as it
  arrives (never whole in memory), within ``SLUICE_MAX_UPLOAD_BYTES`` (413) and the tenant's
  ``SLUICE_TENANT_MAX_STORED_BYTES`` (429) and the tenant's ``SLUICE_TENANT_MAX_UPLOADS``
  (429, arriving and empty uploads included); ``Sluice-Content-SHA256: <hex>`` is checked
  (400 on a mismatch). 201 with the upload and ``Location: /v2/uploads/<id>``. A failed or
  interrupted upload leaves nothing behind, even when this process dies mid-way (its partial
  record, see :mod:`sluice.core.batch_jobs.uploads`, is the sweepers' to remove);
- ``GET /v2/uploads`` (the tenant's), ``GET /v2/uploads/{id}``, ``DELETE /v2/uploads/{id}``.

Another tenant's upload is answered exactly as an unknown one (404).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from dataclasses import dataclass
from typing import cast

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response

from sluice.core.batch_jobs import uploads as u
from sluice.core.batch_jobs.access import LocationPolicy
from sluice.core.batch_jobs.store import (
    CHUNK_BYTES,
    NO_STORE,
    BatchStore,
    S3Clients,
    Writer,
    open_store,
)
from sluice.core.errors import (
    Conflict,
    InvalidInput,
    NotFound,
    PayloadTooLarge,
    QuotaExceeded,
    SluiceError,
    Unavailable,
)
from sluice.gateway.http.body import check_declared_length
from sluice.gateway.http.guard import tenant_of
from sluice.gateway.http.json_body import json_response
from sluice.gateway.state import GatewayState, state_of

log = logging.getLogger("gateway")

upload_router = APIRouter()

SHA256_HEADER = "sluice-content-sha256"
_HEX64 = re.compile(r"[0-9a-fA-F]{64}")
_QUOTA_RETRY_S = 60
MAX_LISTED = 1000


@dataclass(frozen=True)
class BatchData:
    """What a gateway process needs of batch data: the store (None without one) and the
    locations each tenant may name."""

    store: BatchStore | None
    policy: LocationPolicy
    clients: S3Clients

    def need_store(self) -> BatchStore:
        if self.store is None:
            raise Unavailable(NO_STORE)
        return self.store


_BATCH_DATA: dict[int, BatchData] = {}


def batch_data(state: GatewayState) -> BatchData:
    """This gateway's :class:`BatchData`, made once from its settings."""
    settings = state.settings
    data = _BATCH_DATA.get(id(settings))
    if data is None:
        clients = S3Clients(settings)
        data = BatchData(
            open_store(settings, clients), LocationPolicy.from_settings(settings), clients
        )
        _BATCH_DATA[id(settings)] = data
    return data


def quota_message(limit: int) -> str:
    return (
        f"this tenant keeps more than SLUICE_TENANT_MAX_STORED_BYTES ({limit}) bytes in the "
        "batch store (uploads and batch job outputs): delete uploads (DELETE "
        "/v2/uploads/{id}) or old batch jobs (DELETE /v2/batches/{id}), or wait for them "
        "to expire"
    )


@upload_router.post("/v2/uploads")
async def upload(request: Request) -> Response:
    state = state_of(request)
    state.redis_room.check()
    settings = state.settings
    name = request.query_params.get("name")
    if name is None:
        raise InvalidInput("'name' (query parameter) is required: the file's name, e.g. rows.npy")
    u.upload_format(name)
    expected = request.headers.get(SHA256_HEADER)
    if expected is not None and not _HEX64.fullmatch(expected.strip()):
        raise InvalidInput("header 'Sluice-Content-SHA256' must be 64 hexadecimal digits")
    limit = settings.max_upload_bytes
    declared = check_declared_length(request.headers.get("content-length"), 1 << 62)
    if declared is not None and declared > limit:
        raise PayloadTooLarge(
            f"an upload of {declared} bytes exceeds SLUICE_MAX_UPLOAD_BYTES ({limit} bytes)"
        )
    store = batch_data(state).need_store()
    tenant = tenant_of(request.scope)
    keys = state.keys
    quota = settings.tenant_max_stored_bytes
    stored_key = keys.stored_bytes(tenant)
    if declared is not None:
        stored = int(cast(bytes | None, await state.redis.get(stored_key)) or 0)
        if stored + declared > quota:
            raise QuotaExceeded(quota_message(quota), _QUOTA_RETRY_S)
    upload_id = u.new_upload_id()
    await _begin(state, tenant, upload_id)
    reserve = _Reserve(state, tenant, upload_id)
    committed = False
    try:
        writer: Writer = await asyncio.to_thread(store.uploads(tenant).writer, upload_id)
        try:
            buffer = bytearray()
            received = 0
            async for chunk in request.stream():
                received += len(chunk)
                if received > limit:
                    raise PayloadTooLarge(f"upload exceeds SLUICE_MAX_UPLOAD_BYTES ({limit} bytes)")
                buffer += chunk
                if len(buffer) >= CHUNK_BYTES or reserve.due():
                    await reserve(len(buffer))
                    await asyncio.to_thread(writer.write, bytes(buffer))
                    buffer.clear()
            if buffer:
                await reserve(len(buffer))
                await asyncio.to_thread(writer.write, bytes(buffer))
            if declared is not None and received != declared:
                raise InvalidInput(
                    f"the body has {received} bytes, not its Content-Length {declared}"
                )
            digest = writer.sha256()
            if expected is not None and expected.strip().lower() != digest:
                raise InvalidInput(
                    f"header 'Sluice-Content-SHA256' does not match the body (its SHA-256 is "
                    f"{digest}); nothing was kept"
                )
            await asyncio.to_thread(writer.commit)
            committed = True
        except BaseException:
            await asyncio.to_thread(writer.abort)
            raise
        now = time.time()
        expires = now + settings.upload_retention_s
        fields: dict[str, str | int] = {
            u.F_NAME: name,
            u.F_BYTES: received,
            u.F_SHA256: digest,
            u.F_CREATED: f"{now:.6f}",
            u.F_EXPIRES: f"{expires:.0f}",
        }
        member = u.expiry_member(u.UPLOAD, tenant, upload_id)
        commit = state.control.script(u.COMMIT)
        values = [item for pair in fields.items() for item in pair]
        if not int(
            await commit(
                keys=[keys.upload(tenant, upload_id), keys.store_expiry],
                args=[member, expires, *values],
            )
        ):
            raise Conflict(_TAKEN_FOR_DEAD)
    except BaseException:
        # A failure, a refusal or a client gone mid-body: nothing stays. (A gateway that
        # dies here leaves the partial record, which the store sweepers remove.)
        if committed:
            await asyncio.to_thread(store.uploads(tenant).delete, upload_id)
        await _forget(state, tenant, upload_id)
        raise
    log.info("upload %s of tenant %s: %d bytes", upload_id, tenant, received)
    shown = {k: str(v) for k, v in fields.items()}
    answer = json_response(u.describe(upload_id, shown), 201)
    answer.headers["Location"] = f"/v2/uploads/{upload_id}"
    return answer


_TAKEN_FOR_DEAD = (
    "the upload was removed while it arrived: it sent nothing for too long and was taken "
    "for abandoned; upload it again"
)


async def _begin(state: GatewayState, tenant: str, upload_id: str) -> None:
    """The upload's partial record (what it counts is written there from its first byte,
    so that the sweepers can give it back if this process dies), or 429 when its tenant
    keeps as many uploads as it may."""
    keys, limit = state.keys, state.settings.tenant_max_uploads
    now = time.time()
    begin = state.control.script(u.BEGIN)
    began = await begin(
        keys=[keys.upload(tenant, upload_id), keys.uploads(tenant), keys.store_expiry],
        args=[
            upload_id,
            f"{now:.6f}",
            now + u.PARTIAL_UPLOAD_GRACE_S,
            u.expiry_member(u.UPLOAD, tenant, upload_id),
            limit,
        ],
    )
    if int(began) < 0:
        raise QuotaExceeded(
            f"this tenant keeps {limit} uploads, as many as SLUICE_TENANT_MAX_UPLOADS allows: "
            "delete some (DELETE /v2/uploads/{id}) or wait for them to expire",
            _QUOTA_RETRY_S,
        )


class _Reserve:
    """Counts an arriving upload's bytes against its tenant's stored bytes (429 past the
    quota), and renews its partial record's expiry at least every
    :data:`~sluice.core.batch_jobs.uploads.PARTIAL_RENEW_S`."""

    def __init__(self, state: GatewayState, tenant: str, upload_id: str) -> None:
        keys = state.keys
        self.script = state.control.script(u.RESERVE)
        self.keys = [keys.stored_bytes(tenant), keys.upload(tenant, upload_id), keys.store_expiry]
        self.member = u.expiry_member(u.UPLOAD, tenant, upload_id)
        self.quota = state.settings.tenant_max_stored_bytes
        self.renew_at = time.monotonic() + u.PARTIAL_RENEW_S

    def due(self) -> bool:
        return time.monotonic() >= self.renew_at

    async def __call__(self, size: int) -> None:
        self.renew_at = time.monotonic() + u.PARTIAL_RENEW_S
        expires = time.time() + u.PARTIAL_UPLOAD_GRACE_S
        total = int(
            await self.script(keys=self.keys, args=[size, self.quota, expires, self.member])
        )
        if total == -1:
            raise QuotaExceeded(quota_message(self.quota), _QUOTA_RETRY_S)
        if total == -2:
            raise Conflict(_TAKEN_FOR_DEAD)


async def _forget(state: GatewayState, tenant: str, upload_id: str) -> None:
    """Remove a failed upload's record, giving back the bytes it counted; when Redis is
    out of reach, the record stays partial and the sweepers remove it later."""
    try:
        await _remove_record(state, tenant, upload_id)
    except Exception as exc:  # Redis gone: the sweepers take the partial record later
        log.warning("forgetting upload %s failed: %s", upload_id, exc)


async def _remove_record(state: GatewayState, tenant: str, upload_id: str) -> int:
    """Remove an upload's record and give its counted bytes back to the tenant, in one
    script (:data:`~sluice.core.batch_jobs.uploads.REMOVE`): its size, -1 while a batch
    job reads it, -2 when there is none."""
    keys = state.keys
    remove = state.control.script(u.REMOVE)
    return int(
        await remove(
            keys=[
                keys.upload(tenant, upload_id),
                keys.uploads(tenant),
                keys.store_expiry,
                keys.stored_bytes(tenant),
            ],
            args=[upload_id, u.expiry_member(u.UPLOAD, tenant, upload_id)],
        )
    )


async def upload_record(state: GatewayState, tenant: str, upload_id: str) -> dict[str, str]:
    """One of ``tenant``'s uploads; 404 (the same for another tenant's) when none."""
    if not u.is_upload_id(upload_id):
        raise NotFound(f"no upload '{upload_id[:64]}'")
    raw = cast(dict[bytes, bytes], await state.redis.hgetall(state.keys.upload(tenant, upload_id)))
    record = {k.decode(): v.decode(errors="replace") for k, v in raw.items()}
    if not u.is_whole(record):  # (one still arriving is not there yet)
        raise NotFound(f"no upload '{upload_id}'")
    return record


@upload_router.get("/v2/uploads")
async def list_uploads(request: Request) -> Response:
    state = state_of(request)
    tenant = tenant_of(request.scope)
    ids = cast(
        list[bytes], await state.redis.zrevrange(state.keys.uploads(tenant), 0, MAX_LISTED - 1)
    )
    async with state.redis.pipeline(transaction=False) as pipe:
        for raw in ids:
            pipe.hgetall(state.keys.upload(tenant, raw.decode()))
        records = cast(list[dict[bytes, bytes]], await pipe.execute())
    fields = [{k.decode(): v.decode(errors="replace") for k, v in r.items()} for r in records]
    listed = [
        u.describe(raw.decode(), record)
        for raw, record in zip(ids, fields, strict=True)
        if u.is_whole(record)
    ]
    return json_response({"uploads": listed})


@upload_router.get("/v2/uploads/{upload_id}")
async def get_upload(upload_id: str, request: Request) -> Response:
    state = state_of(request)
    record = await upload_record(state, tenant_of(request.scope), upload_id)
    return json_response(u.describe(upload_id, record))


@upload_router.delete("/v2/uploads/{upload_id}")
async def delete_upload(upload_id: str, request: Request) -> Response:
    state = state_of(request)
    tenant = tenant_of(request.scope)
    await upload_record(state, tenant, upload_id)
    size = await _remove_record(state, tenant, upload_id)
    if size == -2:
        raise NotFound(f"no upload '{upload_id}'")
    if size == -1:
        raise Conflict(
            f"upload '{upload_id}' is the input of a batch job; it goes when that job expires"
        )
    store = batch_data(state).store
    if store is not None:
        try:
            await asyncio.to_thread(store.uploads(tenant).delete, upload_id)
        except (OSError, SluiceError) as exc:
            log.warning("removing upload %s's file failed: %s", upload_id, exc)
    return Response(status_code=204)
