"""Two workers that reclaim one dead worker's requests at once (two instances of a model):
each entry is taken by one of them, and its delivery count is its own. Before, the second
claim took the entry again from the first, both computed it, and a poison request killed
one worker more than ``SLUICE_MAX_DELIVERIES`` allows before it was dead-lettered."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any

from redis.asyncio import Redis

from sluice.core.keys import WORKER_GROUP, Keys
from sluice.core.settings import WorkerSettings
from sluice.scheduler.executor.redis_server import RedisServer
from sluice.workers.reclaim import Reclaimer


class _Publisher:
    async def publish(self, outcomes: list[Any]) -> None:
        del outcomes


def test_an_entry_claimed_by_one_reclaimer_is_not_claimed_again(
    redis_server: RedisServer,
) -> None:
    async def main() -> tuple[list[str], list[str], Any]:
        settings = WorkerSettings(namespace=f"race{time.monotonic_ns()}")
        keys = Keys(settings.namespace)
        redis = Redis.from_url(redis_server.url)
        stream = keys.request_stream("m", 1)
        try:
            await redis.xgroup_create(stream, WORKER_GROUP, id="0", mkstream=True)
            await redis.xadd(stream, {b"x": b"1"})
            await redis.xreadgroup(WORKER_GROUP, "dead", {stream: ">"}, count=1)
            await asyncio.sleep(0.3)  # (the dead worker's entry has been idle a while)
            # Worker b looks at what "dead" holds, then worker a claims it first.
            seen_by_b = await redis.xpending_range(
                stream, WORKER_GROUP, min="-", max="+", count=10, consumername="dead"
            )

            def reclaimer(worker: str) -> Reclaimer:
                return Reclaimer(
                    redis,
                    keys,
                    settings,
                    "m",
                    1,
                    worker,
                    [stream],
                    lambda entry_id, fields, stream, level: SimpleNamespace(  # type: ignore[arg-type,return-value]
                        entry_id=entry_id, deliveries=0
                    ),
                    _Publisher(),  # type: ignore[arg-type]
                )

            taken_by_a = await reclaimer("a")._claim(stream, 0, "dead", 0)

            async def stale(*args: Any, **kwargs: Any) -> Any:
                return seen_by_b

            b = reclaimer("b")
            b.redis = Redis.from_url(redis_server.url)
            b.redis.xpending_range = stale  # type: ignore[method-assign]
            taken_by_b = await b._claim(stream, 0, "dead", 0)
            await b.redis.aclose()
            pending = await redis.xpending_range(stream, WORKER_GROUP, min="-", max="+", count=10)
            return (
                [str(r.entry_id) for r in taken_by_a],
                [str(r.entry_id) for r in taken_by_b],
                pending,
            )
        finally:
            await redis.aclose()

    taken_by_a, taken_by_b, pending = asyncio.run(main())
    assert len(taken_by_a) == 1 and taken_by_b == []
    [entry] = pending
    assert entry["consumer"] == b"a" and entry["times_delivered"] == 2
