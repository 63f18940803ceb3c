"""A batch's answers to one gateway go in one reply entry when its requests say the
gateway takes them together; answers to an older gateway (no such flag) go one entry each.
Against a real Redis, read back as the gateways read them."""

from __future__ import annotations

import asyncio
import uuid

from redis import Redis
from redis.asyncio import Redis as AsyncRedis

from sluice.core.keys import Keys
from sluice.core.wire import ReplyMessage, RequestMessage, TensorHeader, decode_replies
from sluice.scheduler.executor.redis_server import RedisServer
from sluice.workers.replies import Outcome, Publisher
from sluice.workers.tensors import PendingRequest


def outcome(number: int, reply_to: str, together: bool) -> Outcome:
    message = RequestMessage(f"k{number}", reply_to, [], ["y"], replies_together=together)
    request = PendingRequest(f"{number}-0".encode(), message, memoryview(b""), 1, (), "s")
    reply = ReplyMessage(f"k{number}", 1, [TensorHeader("y", "UINT8", (1, 1), 1)])
    return Outcome(request, reply, bytes([number]))


def test_one_entry_per_gateway_that_takes_answers_together(redis_server: RedisServer) -> None:
    keys = Keys(f"t{uuid.uuid4().hex[:8]}")
    new, old = f"{keys.namespace}:reply:new", f"{keys.namespace}:reply:old"
    outcomes = [outcome(1, new, True), outcome(2, old, False), outcome(3, new, True)]
    outcomes.append(outcome(4, old, False))

    async def publish() -> bool:
        client = AsyncRedis.from_url(redis_server.url)
        try:
            publisher = Publisher(client, keys, "m", 1, "w", 1000)
            return await publisher.publish(outcomes)
        finally:
            await client.aclose()

    assert asyncio.run(publish())
    with Redis.from_url(redis_server.url) as redis:
        entries = {name: redis.xrange(name) for name in (new, old)}
    assert len(entries[new]) == 1 and len(entries[old]) == 2
    together = decode_replies(entries[new][0][1])
    assert [(m.request_key, bytes(p)) for m, p in together] == [("k1", b"\x01"), ("k3", b"\x03")]
    apart = [decode_replies(fields) for _, fields in entries[old]]
    assert [[m.request_key for m, _ in replies] for replies in apart] == [["k2"], ["k4"]]
