"""Uploads: files a tenant sends through the gateway (``POST /v2/uploads``) for its batch
jobs to read, kept in the batch store (:mod:`sluice.core.batch_jobs.store`) under
``<tenant>/uploads/<id>``.

Record layout (all in the deployment's control slot, so the scripts below touch one slot):
``Keys.upload(tenant, id)`` (hash, fields below), ``Keys.uploads(tenant)`` (the tenant's
listing), ``Keys.stored_bytes(tenant)`` (what the tenant keeps in the store) and
``Keys.store_expiry`` (when each upload and finished batch job goes; the batch workers'
sweeper removes it, files and all). An upload a batch job uses (``"input": "upload:<id>"``)
does not expire before that job does.
"""

from __future__ import annotations

import re
import uuid
from typing import Any

from sluice.core.errors import InvalidInput

INPUT_PREFIX = "upload:"
"""A batch job's ``input`` naming one of the tenant's uploads: ``upload:<id>``."""

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,120}\.(npy|npz|parquet|jsonl)")
_ID = re.compile(r"[0-9a-f]{32}")

F_NAME, F_BYTES, F_SHA256, F_CREATED, F_EXPIRES, F_USERS = (
    "name",
    "bytes",
    "sha256",
    "created",
    "expires",
    "users",
)

UPLOAD, BATCH = "upload", "batch"
"""Kinds of :data:`Keys.store_expiry` members."""


def upload_format(name: Any) -> str:
    """The format an upload's ``name`` tells by its extension; 400 naming ``name``."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise InvalidInput(
            "'name' must be a file name (letters, digits, '_', '.', '-', at most 128) ending "
            "in .npy, .npz, .parquet or .jsonl"
        )
    return name.rsplit(".", 1)[1]


def new_upload_id() -> str:
    return uuid.uuid4().hex


def is_upload_id(value: str) -> bool:
    return bool(_ID.fullmatch(value))


def expiry_member(kind: str, tenant: str, item_id: str) -> str:
    return f"{kind}:{tenant}:{item_id}"


def parse_expiry_member(member: str) -> tuple[str, str, str]:
    """(kind, tenant, id) of a :data:`Keys.store_expiry` member."""
    kind, tenant, item_id = member.split(":", 2)
    return kind, tenant, item_id


def describe(upload_id: str, fields: dict[str, str]) -> dict[str, Any]:
    """An upload as a client sees it."""
    return {
        "id": upload_id,
        "name": fields.get(F_NAME, ""),
        "bytes": int(fields.get(F_BYTES) or 0),
        "sha256": fields.get(F_SHA256, ""),
        "created": round(float(fields.get(F_CREATED) or 0), 3),
        "expires": int(float(fields.get(F_EXPIRES) or 0)),
        "in_use": int(fields.get(F_USERS) or 0) > 0,
    }


RESERVE = """
-- KEYS: stored bytes; ARGV: bytes, limit
local now = tonumber(redis.call('GET', KEYS[1]) or '0')
if now + tonumber(ARGV[1]) > tonumber(ARGV[2]) then return -1 end
return redis.call('INCRBY', KEYS[1], ARGV[1])
"""
"""Count ``bytes`` more against a tenant's store limit: the new total, or -1 (over it)."""

USE = """
-- KEYS: upload hash, store expiry; ARGV: expiry member
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HINCRBY', KEYS[1], 'users', 1)
redis.call('ZADD', KEYS[2], '+inf', ARGV[1])
return 1
"""
"""A batch job starts using an upload: it no longer expires (1), or it is gone (0)."""

RELEASE = """
-- KEYS: upload hash, store expiry; ARGV: expiry member, now (unix s)
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
local users = redis.call('HINCRBY', KEYS[1], 'users', -1)
if users > 0 then return 1 end
redis.call('HSET', KEYS[1], 'users', 0)
local expires = tonumber(redis.call('HGET', KEYS[1], 'expires') or '0')
redis.call('ZADD', KEYS[2], math.max(expires, tonumber(ARGV[2])), ARGV[1])
return 1
"""
"""A batch job that used an upload expired: the upload expires when it was to, or now."""

REMOVE = """
-- KEYS: upload hash, tenant's uploads, store expiry, tenant's stored bytes;
-- ARGV: upload id, expiry member
if redis.call('EXISTS', KEYS[1]) == 0 then return -2 end
if tonumber(redis.call('HGET', KEYS[1], 'users') or '0') > 0 then return -1 end
local size = tonumber(redis.call('HGET', KEYS[1], 'bytes') or '0')
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[2])
if size > 0 then redis.call('DECRBY', KEYS[4], size) end
return size
"""
"""Forget an upload no batch job uses, and give its bytes back to its tenant's quota in the
same step (an upload that is gone no longer counts): its size (its file is the caller's to
delete); -1 while a batch job uses it; -2 when there is none."""
