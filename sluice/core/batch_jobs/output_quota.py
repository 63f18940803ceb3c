"""A batch job's files in the batch store, counted against its tenant's stored bytes (the
quota uploads count against too, ``SLUICE_TENANT_MAX_STORED_BYTES``).

What a batch keeps in the store is counted in two places at once, by one script, both in
the deployment's control slot: the tenant's total (``Keys.stored_bytes``, which uploads
count in too) and the batch's own share of it (``Keys.batch_stored``). The batch workers
count a file before it goes into the store (:data:`CHARGE`, refused past the quota), and an
output still being written in pieces as it grows, so that the quota holds before the
store fills; whoever removes the batch (a store sweeper when it expires, the gateway when
its tenant deletes it) gives its whole share back in one step (:data:`RELEASE`). A batch
worker that dies mid-write therefore leaks nothing for good: what it counted is the
batch's, and goes back when the batch goes.

The tenant's listing entry of the batch (``Keys.batches``) says that the batch exists:
:data:`RELEASE` removes it together with the share, so a shard of a batch removed
meanwhile (a zombie, or one still writing as its tenant deleted the job) counts nothing
and puts nothing more.
"""

from __future__ import annotations

from sluice.core.keys import Keys

CHARGE = """
-- KEYS: the tenant's stored bytes, the tenant's batch shares, the tenant's batches
-- ARGV: batch id, bytes (negative: given back), the tenant's limit
if not redis.call('ZSCORE', KEYS[3], ARGV[1]) then return -2 end
local size = tonumber(ARGV[2])
if size > 0 and tonumber(redis.call('GET', KEYS[1]) or '0') + size > tonumber(ARGV[3]) then
  return -1
end
redis.call('HINCRBY', KEYS[2], ARGV[1], size)
return redis.call('INCRBY', KEYS[1], size)
"""
"""Count ``bytes`` more (or fewer) of a batch's files against its tenant: the tenant's new
total; -1 over the limit (nothing counted; giving back is never refused); -2 the batch is
gone (removed: its share was given back whole, so nothing is counted either way)."""

OVER_QUOTA, GONE = -1, -2
""":data:`CHARGE`'s refusals."""

RELEASE = """
-- KEYS: the tenant's stored bytes, the tenant's batch shares, the tenant's batches
-- ARGV: batch id, bytes counted in the batch's own record (by a release before this one)
if redis.call('ZREM', KEYS[3], ARGV[1]) == 0 then return -1 end
local size = tonumber(redis.call('HGET', KEYS[2], ARGV[1]) or '0') + tonumber(ARGV[2])
redis.call('HDEL', KEYS[2], ARGV[1])
if size ~= 0 then redis.call('DECRBY', KEYS[1], size) end
return size
"""
"""A batch is removed: out of its tenant's listing, and every byte it counted given back,
in one step: the bytes given back; -1 when it was removed already (by another sweeper, or
its tenant): only the caller that got a size goes on to remove the rest of it."""


def quota_keys(keys: Keys, tenant: str) -> list[str]:
    """The KEYS of :data:`CHARGE` and :data:`RELEASE` for ``tenant``."""
    return [keys.stored_bytes(tenant), keys.batch_stored(tenant), keys.batches(tenant)]


def over_quota_message(limit: int, batch_id: str) -> str:
    """Why a running batch job stopped: its tenant would keep more than its quota."""
    return (
        f"the tenant would keep more than SLUICE_TENANT_MAX_STORED_BYTES ({limit}) bytes in "
        "the batch store: the job stopped before writing more (what its finished shards "
        f"wrote stays readable: GET /v2/batches/{batch_id}/outputs); delete old batch jobs "
        "(DELETE /v2/batches/{id}) or uploads, then resume it"
    )
