"""Removes what expired from the batch store: uploads past ``SLUICE_UPLOAD_RETENTION_S``
(unless a batch job uses them) and finished batch jobs past ``SLUICE_BATCH_RETENTION_S``
(their record, listing entry and files in the store), giving their bytes back to their
tenant. Every batch worker and every gateway process with a batch store runs one, so that
a deployment without batch workers still lets uploads go; ``Keys.store_expiry`` says what
is due, and each item is taken by one sweeper only (the scripts of
:mod:`sluice.core.batch_jobs.uploads`, a ``ZREM`` for batches). A tenant's
``DELETE /v2/batches/{id}`` removes a finished batch the same way
(:meth:`StoreSweeper.remove_batch`).

An item's bytes go back to its tenant in the same step as its record or listing entry,
before its files are deleted: a sweeper that dies in between leaves files that no longer
count, never a quota counted for good.
"""

from __future__ import annotations

import logging
import time
from typing import cast

from redis import Redis

from sluice.core.batch_jobs import batches as b
from sluice.core.batch_jobs import output_quota as oq
from sluice.core.batch_jobs import turns
from sluice.core.batch_jobs import uploads as u
from sluice.core.batch_jobs.store import BatchStore
from sluice.core.keys import Keys

log = logging.getLogger(__name__)

_PER_SWEEP = 100
_DELETED_AT_ONCE = 1000


class StoreSweeper:
    def __init__(self, redis: Redis, keys: Keys, store: BatchStore | None) -> None:
        self.redis, self.keys, self.store = redis, keys, store

    def sweep_all(self) -> None:
        """Remove everything that is due now, :data:`_PER_SWEEP` items at a time."""
        while self.sweep() >= _PER_SWEEP:
            pass

    def sweep(self, now: float | None = None) -> int:
        """Remove what is due at ``now`` (default: now); how many items were removed."""
        now = time.time() if now is None else now
        due = cast(
            list[bytes],
            self.redis.zrangebyscore(self.keys.store_expiry, "-inf", now, 0, _PER_SWEEP),
        )
        removed = 0
        for raw in due:
            kind, tenant, item_id = u.parse_expiry_member(raw.decode())
            if kind == u.UPLOAD:
                removed += self._upload(tenant, item_id, raw.decode())
            elif kind == u.BATCH:
                removed += self._batch(tenant, item_id, raw.decode(), now)
        return removed

    def _upload(self, tenant: str, upload_id: str, member: str) -> int:
        keys = self.keys
        size = int(
            cast(
                int,
                self.redis.eval(
                    u.REMOVE,
                    4,
                    keys.upload(tenant, upload_id),
                    keys.uploads(tenant),
                    keys.store_expiry,
                    keys.stored_bytes(tenant),
                    upload_id,
                    member,
                ),
            )
        )
        if size == -1:
            return 0  # a batch job took it meanwhile (its score is +inf again)
        self.redis.zrem(keys.store_expiry, member)
        if size >= 0:
            if self.store is not None:  # (with what a gateway that died mid-upload left)
                self.store.uploads(tenant).discard(upload_id)
            log.info("upload %s of tenant %s expired", upload_id, tenant)
        return 1

    def _batch(self, tenant: str, batch_id: str, member: str, now: float) -> int:
        keys = self.keys
        if not self.redis.zrem(keys.store_expiry, member):
            return 0  # another sweeper has it
        raw = cast(dict[bytes, bytes], self.redis.hgetall(keys.batch(batch_id)))
        record = {k.decode(): v.decode(errors="replace") for k, v in raw.items()}
        if record and record.get(b.F_STATUS) not in b.FINISHED:
            return 0  # resumed since it ended: it expires when it ends again
        removed = self.remove_batch(tenant, batch_id, record, now)
        if removed:
            log.info("batch %s of tenant %s expired", batch_id, tenant)
        return int(removed)

    def remove_batch(
        self, tenant: str, batch_id: str, record: dict[str, str], now: float | None = None
    ) -> bool:
        """Remove a finished batch (``record``: its hash as read): out of its tenant's
        listing with every byte it counted given back, in one step, then its files in the
        store, its records and reply streams, and its hold on its upload. False when it was
        removed already (by a sweeper, or by its tenant): nothing is done then."""
        keys = self.keys
        now = time.time() if now is None else now
        given = int(
            cast(
                int,
                self.redis.eval(
                    oq.RELEASE,
                    3,
                    *oq.quota_keys(keys, tenant),
                    batch_id,
                    int(record.get(b.F_STORED) or 0),
                ),
            )
        )
        if given < 0:
            return False
        self.redis.zrem(keys.store_expiry, u.expiry_member(u.BATCH, tenant, batch_id))
        turns.forget(self.redis, keys, tenant, batch_id)  # (a turn it still held, if any)
        if self.store is not None and not record.get(b.F_OUTPUT):
            self.store.batch_outputs(tenant, batch_id).delete_tree()
        self._reply_streams(batch_id)
        self.redis.delete(
            keys.batch(batch_id),
            keys.batch_shards(batch_id),
            keys.batch_attempts(batch_id),
            keys.batch_progress(batch_id),
            keys.batch_leases(batch_id),
            keys.batch_in_flight(batch_id),
        )
        source = record.get(b.F_INPUT, "")
        if b.is_upload_input(source):
            upload_id = b.upload_of(source)
            self.redis.eval(
                u.RELEASE,
                2,
                keys.upload(tenant, upload_id),
                keys.store_expiry,
                u.expiry_member(u.UPLOAD, tenant, upload_id),
                repr(now),  # (exactly: rounded up, it would fall due after now)
            )
        return True

    def _reply_streams(self, batch_id: str) -> None:
        """Delete the reply streams of every attempt of the batch's shards: one whose batch
        worker was killed may have been made anew by a late answer, without an expiry."""
        keys = self.keys
        attempts = cast(dict[bytes, bytes], self.redis.hgetall(keys.batch_attempts(batch_id)))
        streams = [
            keys.batch_reply_stream(batch_id, int(shard), attempt)
            for shard, newest in attempts.items()
            for attempt in range(1, int(newest) + 1)
        ]
        for first in range(0, len(streams), _DELETED_AT_ONCE):
            with self.redis.pipeline(transaction=False) as pipe:
                for stream in streams[first : first + _DELETED_AT_ONCE]:
                    pipe.delete(stream)  # (one key a command: each in a slot of its own)
                pipe.execute()
