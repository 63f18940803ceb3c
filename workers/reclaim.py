"""Taking over requests held by dead (or stuck) workers of the same model version.

A worker that dies leaves its entries pending in the consumer group. Every
live worker periodically looks at the other consumers: entries of a consumer
without a heartbeat are claimed at once; entries of a live one only after the
visibility timeout. An entry delivered ``max_deliveries`` times has killed
that many workers: it goes to the dead-letter stream and its client gets an
error instead of a fourth victim.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import RedisError

from sluice.core.clock import CLOCK
from sluice.core.errors import InferenceFailed
from sluice.core.keys import WORKER_GROUP, Keys
from sluice.core.observability import statistics as st
from sluice.core.redis_client.types import StreamEntry
from sluice.core.settings import WorkerSettings
from sluice.workers.replies import Outcome, Publisher, error_outcome
from sluice.workers.tensors import PendingRequest

log = logging.getLogger(__name__)

_CLAIM_BATCH = 256
_DEAD_LETTER_MAX_LEN = 10_000

Parse = Callable[[bytes, dict[bytes, bytes], str, int], "PendingRequest | Outcome | None"]


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


@dataclass
class Reclaimer:
    redis: Redis
    keys: Keys
    settings: WorkerSettings
    model: str
    version: int
    worker_id: str
    streams: list[str]
    parse: Parse
    publisher: Publisher
    levels: dict[str, int] | None = None
    """Stream -> its level, where ``streams`` holds tenant streams (else: its index)."""

    async def reclaim(self) -> list[PendingRequest]:
        """Claim what dead workers held; returns the requests to process here."""
        now = CLOCK.now()
        live_key = self.keys.live_workers(self.model, self.version)
        # One round trip for the look (what an idle worker does every interval).
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.zrangebyscore(live_key, now, "+inf")
            for stream in self.streams:
                pipe.xinfo_consumers(stream, WORKER_GROUP)
            members, *consumers_of = await pipe.execute()
        live = {_text(m) for m in members}
        dead_idle_ms = int(3 * self.settings.heartbeat_s * 1000)
        claimed: list[PendingRequest] = []
        streams = self.streams
        for (index, stream), consumers in zip(enumerate(streams), consumers_of, strict=True):
            level = self.levels.get(stream, index) if self.levels is not None else index
            for consumer in consumers:
                name = _text(consumer["name"])
                if name == self.worker_id:
                    continue
                alive = name in live
                if not consumer["pending"]:
                    if not alive and consumer["idle"] > dead_idle_ms:
                        await self.redis.xgroup_delconsumer(stream, WORKER_GROUP, name)
                    continue
                min_idle = int(self.settings.visibility_timeout_s * 1000) if alive else 0
                claimed += await self._claim(stream, level, name, min_idle)
        return claimed

    async def take_over(self, stream: str, level: int) -> list[PendingRequest]:
        """Everything other consumers hold on ``stream``, oldest first, whether they still
        beat or not: for a stream that one worker alone reads (a sequence model's slot),
        the others are its predecessors."""
        claimed: list[PendingRequest] = []
        for consumer in await self.redis.xinfo_consumers(stream, WORKER_GROUP):
            name = _text(consumer["name"])
            if name == self.worker_id:
                continue
            while True:
                taken = await self._claim(stream, level, name, 0)
                claimed += taken
                if not taken:
                    break
            await self.redis.xgroup_delconsumer(stream, WORKER_GROUP, name)
        claimed.sort(key=lambda request: _entry_order(request.entry_id))
        return claimed

    async def _claim(
        self, stream: str, level: int, consumer: str, min_idle: int
    ) -> list[PendingRequest]:
        pending = await self.redis.xpending_range(
            stream,
            WORKER_GROUP,
            min="-",
            max="+",
            count=_CLAIM_BATCH,
            consumername=consumer,
            idle=min_idle,
        )
        if not pending:
            return []
        deliveries = {p["message_id"]: int(p["times_delivered"]) for p in pending}
        # Another worker may claim the same entries between this look and the claim (two
        # instances reclaiming one dead worker's requests at once): its claim makes them
        # idle again, so claiming only what is still about as idle as it looked takes each
        # entry once, and the delivery count read above stays the entry's own.
        idle_ms = min(int(p["time_since_delivered"]) for p in pending)
        entries: list[StreamEntry] = await self.redis.xclaim(  # type: ignore[assignment]
            stream, WORKER_GROUP, self.worker_id, max(min_idle, idle_ms // 2), list(deliveries)
        )
        requests: list[PendingRequest] = []
        rejected: list[Outcome] = []
        dead = 0
        for entry_id, fields in entries:
            if not fields:
                continue
            parsed = self.parse(entry_id, fields, stream, level)
            if isinstance(parsed, Outcome):
                rejected.append(parsed)
            elif parsed is not None:
                parsed.deliveries = deliveries.get(entry_id, 1) + 1
                if parsed.deliveries > self.settings.max_deliveries:
                    rejected.append(await self._dead_letter(parsed, fields, consumer))
                    dead += 1
                else:
                    requests.append(parsed)
        if requests or rejected:
            log.warning(
                "took over %d requests of worker %s from %s (%d dead-lettered)",
                len(requests),
                consumer,
                stream,
                dead,
            )
            await self._count(len(requests) + dead, dead)
        await self.publisher.publish(rejected)
        return requests

    async def _count(self, reclaimed: int, dead: int) -> None:
        """Add to the reclaimed and dead-lettered counters (``sluice_*`` metrics)."""
        stats = self.keys.stats(self.model, self.version)
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.hincrby(stats, st.RECLAIMED, reclaimed)
                if dead:
                    pipe.hincrby(stats, st.DEAD_LETTERED, dead)
                await pipe.execute()
        except RedisError as exc:
            log.warning("counting reclaimed entries failed: %s", exc)

    async def _dead_letter(
        self, request: PendingRequest, fields: dict[bytes, bytes], consumer: str
    ) -> Outcome:
        delivered = request.deliveries - 1
        reason = f"delivered {delivered} times; last worker {consumer}".encode()
        entry: dict[Any, Any] = {**fields, b"reason": reason}
        await self.redis.xadd(
            self.keys.dead_letters(self.model, self.version),
            entry,
            maxlen=_DEAD_LETTER_MAX_LEN,
            approximate=True,
        )
        error = InferenceFailed(
            f"the request was delivered {delivered} times and its worker died each time; "
            "it was moved to the dead-letter stream"
        )
        return error_outcome(request, self.version, error)


def _entry_order(entry_id: bytes) -> tuple[int, int]:
    milliseconds, _, sequence = entry_id.decode().partition("-")
    return int(milliseconds), int(sequence or 0)
