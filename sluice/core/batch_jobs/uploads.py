"""Uploads: files a tenant sends through the gateway (``POST /v2/uploads``) for its batch
jobs to read, kept in the batch store (:mod:`sluice.core.batch_jobs.store`) under
``<tenant>/uploads/<id>``.

Record layout (all in the deployment's control slot, so the scripts below touch one slot):
``Keys.upload(tenant, id)`` (hash, fields below), ``Keys.uploads(tenant)`` (the tenant's
listing), ``Keys.stored_bytes(tenant)`` (what the tenant keeps in the store) and
``Keys.store_expiry`` (when each upload and finished batch job goes; the batch workers'
sweeper removes it, files and all). An upload a batch job uses (``"input": "upload:<id>"``)
does not expire before that job does.

An upload has its record from its first byte (:data:`BEGIN`), marked partial: the bytes it
counts against its tenant are written there as they are counted (:data:`RESERVE`), and its
expiry is renewed as its body arrives, :data:`PARTIAL_UPLOAD_GRACE_S` ahead. So an upload
whose gateway died (no handler of its ran) is removed by the sweepers like an expired one,
its bytes given back and its partial file deleted. A partial upload is not listed, found or
usable; :data:`COMMIT` makes it whole.
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

F_NAME, F_BYTES, F_SHA256, F_CREATED, F_EXPIRES, F_USERS, F_PARTIAL = (
    "name",
    "bytes",
    "sha256",
    "created",
    "expires",
    "users",
    "partial",
)

PARTIAL_UPLOAD_GRACE_S = 600.0
"""An upload still arriving is kept this long after its last renewal (its body renews it
at least every :data:`PARTIAL_RENEW_S` while bytes arrive, and the gateway closes a body
silent for SLUICE_BODY_TIMEOUT_S); past it, its gateway is taken for dead."""

PARTIAL_RENEW_S = 60.0
"""How often an arriving upload renews its expiry (and counts what it buffered)."""

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


def is_whole(fields: dict[str, str]) -> bool:
    """Whether an upload's record is of a whole upload (not one still arriving, or cut
    off by its gateway's death)."""
    return bool(fields) and F_PARTIAL not in fields


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


BEGIN = """
-- KEYS: upload hash, tenant's uploads, store expiry;
-- ARGV: upload id, now (unix s), expires (unix s), expiry member, tenant's max uploads
if redis.call('ZCARD', KEYS[2]) >= tonumber(ARGV[5]) then return -1 end
redis.call('HSET', KEYS[1], 'partial', 1, 'bytes', 0, 'users', 0, 'created', ARGV[2])
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[1])
redis.call('ZADD', KEYS[3], ARGV[3], ARGV[4])
return 1
"""
"""An upload begins, as a partial record that expires unless renewed: 1, or -1 when its
tenant keeps as many uploads (arriving ones included) as it may."""

RESERVE = """
-- KEYS: stored bytes, upload hash, store expiry; ARGV: bytes, limit, expires, expiry member
if redis.call('HGET', KEYS[2], 'partial') ~= '1' then return -2 end
local now = tonumber(redis.call('GET', KEYS[1]) or '0')
if now + tonumber(ARGV[1]) > tonumber(ARGV[2]) then return -1 end
redis.call('HINCRBY', KEYS[2], 'bytes', ARGV[1])
redis.call('ZADD', KEYS[3], ARGV[3], ARGV[4])
return redis.call('INCRBY', KEYS[1], ARGV[1])
"""
"""Count ``bytes`` more of an arriving upload against its tenant's store limit, in the
upload's record too, and renew its expiry: the new total; -1 (over the limit); -2 (the
upload is gone: a sweeper took it for dead)."""

COMMIT = """
-- KEYS: upload hash, store expiry; ARGV: expiry member, expires (unix s), field, value, ...
if redis.call('HGET', KEYS[1], 'partial') ~= '1' then return 0 end
redis.call('HDEL', KEYS[1], 'partial')
redis.call('HSET', KEYS[1], unpack(ARGV, 3))
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[1])
return 1
"""
"""The upload's file is in place: its record is whole, and it expires after its retention
(1), or it is gone (0: a sweeper took it for dead, its bytes given back)."""

USE = """
-- KEYS: upload hash, store expiry; ARGV: expiry member
if redis.call('EXISTS', KEYS[1]) == 0 or redis.call('HEXISTS', KEYS[1], 'partial') == 1 then
  return 0
end
redis.call('HINCRBY', KEYS[1], 'users', 1)
redis.call('ZADD', KEYS[2], '+inf', ARGV[1])
return 1
"""
"""A batch job starts using an upload: it no longer expires (1), or it is gone or still
arriving (0)."""

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
