"""A batch's files in the batch store, counted against its tenant's stored bytes by the
batch worker that writes them (the scripts and the rules:
:mod:`sluice.core.batch_jobs.output_quota`).

Every byte is counted before it is written: a whole part before it is put in the store,
and a file that grows as answers come (JSON Lines, the joined ``.npy`` outputs) before each
piece goes into its scratch file. Past the quota the write is refused with
:class:`OverQuota` and the job stops; a batch removed meanwhile is :class:`Cancelled` for
its shards.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import cast

from redis import Redis
from redis.exceptions import RedisError

from sluice.batch.feeder import Cancelled
from sluice.core.batch_jobs import output_quota as oq
from sluice.core.errors import InvalidInput
from sluice.core.keys import Keys

log = logging.getLogger("batch")

RESERVE_AHEAD = 4 << 20
"""A growing file is counted up to this many bytes ahead of what is written of it (fewer
where the quota has no room for them), so that it costs a round trip to Redis per few
MiB, not per line."""


class OverQuota(InvalidInput):
    """The tenant would keep more than SLUICE_TENANT_MAX_STORED_BYTES: the job stops."""


@dataclass(frozen=True)
class StoredBytes:
    """One batch's account of what its files keep in the store. A batch writing to a
    location of the client's own (``counted`` False) counts nothing."""

    redis: Redis
    keys: Keys
    tenant: str
    batch_id: str
    limit: int
    counted: bool

    def charge(self, size: int) -> None:
        """Count ``size`` bytes more (negative: fewer). OverQuota past the quota (nothing
        counted), Cancelled when the batch was removed (its share was given back whole:
        nothing is counted, and nothing more may be written)."""
        if not self.counted or not size:
            return
        total = int(
            cast(
                int,
                self.redis.eval(
                    oq.CHARGE,
                    3,
                    *oq.quota_keys(self.keys, self.tenant),
                    self.batch_id,
                    size,
                    self.limit,
                ),
            )
        )
        if total == oq.OVER_QUOTA:
            raise OverQuota(oq.over_quota_message(self.limit, self.batch_id))
        if total == oq.GONE and size > 0:
            raise Cancelled(f"batch {self.batch_id} was removed")

    def exists(self) -> bool:
        """Whether the batch is still there (not removed, with its files, meanwhile)."""
        if not self.counted:
            return True
        return self.redis.zscore(self.keys.batches(self.tenant), self.batch_id) is not None

    def reservation(self) -> Reservation:
        return Reservation(self)


class Reservation:
    """What is counted for one file of the batch while it is made: never less than what was
    written of it (:meth:`cover` before each write), then exactly its size once it is put
    (:meth:`settle`), or nothing once it is dropped (:meth:`release`)."""

    def __init__(self, stored: StoredBytes) -> None:
        self.stored = stored
        self.counted = 0

    def cover(self, size: int) -> None:
        """Count the file as at least ``size`` bytes (OverQuota where they do not fit)."""
        if size <= self.counted:
            return
        need = size - self.counted
        ahead = min(RESERVE_AHEAD, size)
        try:
            self.stored.charge(need + ahead)
            self.counted += need + ahead
        except OverQuota:  # no room ahead: the bytes needed, if they fit
            self.stored.charge(need)
            self.counted += need

    def settle(self, size: int) -> None:
        """Count exactly ``size`` bytes for the file (OverQuota when they do not fit: what
        was counted before stays counted, for :meth:`release`)."""
        self.stored.charge(size - self.counted)
        self.counted = size

    def hand_over(self) -> None:
        """The file is in the store: what it counts is the batch's now (given back with it
        when the batch is removed, or by whoever withdraws the file), not this
        reservation's to release."""
        self.counted = 0

    def release(self) -> None:
        """Give back everything counted for the file (it is not in the store). When Redis
        is out of reach, it stays counted in the batch's share, given back with it."""
        counted, self.counted = self.counted, 0
        try:
            self.stored.charge(-counted)
        except RedisError as exc:
            log.warning(
                "batch %s: giving back %d bytes failed (%s); they go back with the batch",
                self.stored.batch_id,
                counted,
                exc,
            )
