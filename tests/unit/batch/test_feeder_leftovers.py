"""What a shard leaves in Redis when it stops early, on a real redis-server with no model
worker reading (so every request stays queued):

- a cancelled shard (or one whose request failed) withdraws its requests still out: they
  used to stay in the model's queue, be computed for nobody, and be answered into the
  shard's reply stream after it was deleted, making it anew with no expiry: a stream
  left for good per stopped shard;
- the reply stream expires while the shard runs (a killed batch worker's goes away) and
  after it is closed, so a late answer lands in a stream that expires;
- when a batch job expires, the reply streams of all its shards' attempts go with it."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import numpy as np
import pytest
from redis import Redis

from sluice.batch.feeder import REPLY_GRACE_S, Cancelled, Feeder
from sluice.core.batch_jobs import batches as b
from sluice.core.batch_jobs import uploads as u
from sluice.core.batch_jobs.sweeper import StoreSweeper
from sluice.core.cancellation import parse_notice
from sluice.core.config import parse_config_text
from sluice.core.keys import Keys
from sluice.scheduler.executor.redis_server import RedisServer

CONFIG = parse_config_text(
    """
    name: "m"
    backend: "python"
    max_batch_size: 4
    input [ { name: "X" data_type: TYPE_FP32 dims: [ 2 ] } ]
    output [ { name: "Y" data_type: TYPE_FP32 dims: [ 2 ] } ]
    """,
    model_name="m",
)


@pytest.fixture
def redis(redis_server: RedisServer) -> Iterator[Redis]:
    client = Redis.from_url(redis_server.url)
    yield client
    client.close()


def test_a_cancelled_shard_withdraws_its_requests_and_its_replies_expire(redis: Redis) -> None:
    keys = Keys(f"t{uuid.uuid4().hex[:8]}")
    reply_stream = keys.batch_reply_stream("b" * 32, 0, 1)
    ttl_while_running: list[int] = []

    def cancelled() -> bool:
        ttl_while_running.append(int(redis.ttl(reply_stream)))
        return True

    feeder = Feeder(
        redis, keys, CONFIG, 1, reply_stream, 4, 3, 60.0, "batch-test", cancelled=cancelled
    )
    with pytest.raises(Cancelled):
        feeder.run({"X": np.zeros((40, 2), dtype=np.float32)})
    feeder.close()

    assert redis.xlen(feeder.stream) == 0, "the shard's requests stayed queued"
    notices = redis.xrange(keys.cancellations("m"))
    named = {parse_notice(fields) for _, fields in notices}
    assert named == {(reply_stream, key) for key in ("0", "1", "2")}
    assert ttl_while_running and 0 < ttl_while_running[0] <= 60 + REPLY_GRACE_S
    redis.xadd(reply_stream, {"late": "answer"})  # a request that was computing meanwhile
    assert 0 < redis.ttl(reply_stream) <= REPLY_GRACE_S


def test_an_expired_batch_takes_the_reply_streams_of_its_attempts(redis: Redis) -> None:
    keys = Keys(f"t{uuid.uuid4().hex[:8]}")
    batch_id = uuid.uuid4().hex
    redis.hset(keys.batch(batch_id), mapping={b.F_STATUS: b.FAILED, b.F_OUTPUT: "/elsewhere"})
    redis.zadd(keys.batches("team-a"), {batch_id: 1.0})  # (listed, as the gateway lists it)
    redis.hset(keys.batch_attempts(batch_id), mapping={"0": 2, "1": 1})
    streams = [
        keys.batch_reply_stream(batch_id, 0, 1),
        keys.batch_reply_stream(batch_id, 0, 2),
        keys.batch_reply_stream(batch_id, 1, 1),
    ]
    for stream in streams:  # late answers to attempts whose batch worker was killed
        redis.xadd(stream, {"late": "answer"})
    redis.zadd(keys.store_expiry, {u.expiry_member(u.BATCH, "team-a", batch_id): time.time()})
    StoreSweeper(redis, keys, None).sweep(time.time() + 1)
    assert not redis.exists(keys.batch(batch_id))
    assert [s for s in streams if redis.exists(s)] == []
