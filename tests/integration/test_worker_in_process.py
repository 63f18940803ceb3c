"""A worker run in the test's own event loop against a test Redis, without ``sluice up``:
a request through the core's dispatcher gets its answer, and the worker stops cleanly."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
from redis.asyncio import Redis

from sluice.core.dispatch import RedisDispatcher
from sluice.core.keys import Keys
from sluice.core.settings import WorkerSettings
from sluice.core.wire import RequestMessage, TensorHeader
from sluice.scheduler.executor.redis_server import RedisServer
from sluice.workers.inprocess import running_worker
from tests.support.onnx_models import write_identity


async def test_a_worker_in_process_answers_a_dispatched_request(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    write_identity(tmp_path, "identity", ["FP32"])
    namespace = f"inproc{time.monotonic_ns()}"
    settings = WorkerSettings(redis_url=redis_server.url, namespace=namespace)
    keys = Keys(namespace)
    redis, reader = Redis.from_url(redis_server.url), Redis.from_url(redis_server.url)
    dispatcher = RedisDispatcher(redis, reader, keys, stream_max_len=1000)
    await dispatcher.start()
    data = np.arange(8, dtype=np.float32).reshape(2, 4)
    try:
        async with running_worker(settings, tmp_path, "identity") as worker:
            message = RequestMessage(
                "", "", [TensorHeader("IN_FP32", "FP32", (2, 4), data.nbytes)], ["OUT_FP32"]
            )
            stream = keys.request_stream("identity", 1)
            reply, payload = await dispatcher.submit(
                "identity", stream, message, data.tobytes(), timeout_s=30
            )
        assert worker.exit_status == 0
        assert reply.error == "" and reply.model_version == 1
        [output] = reply.outputs
        assert (output.name, output.shape) == ("OUT_FP32", (2, 4))
        np.testing.assert_array_equal(np.frombuffer(payload, np.float32).reshape(2, 4), data)
        live = await redis.zrange(keys.live_workers("identity", 1), 0, -1)
        assert live == []  # it left the live workers as it stopped
    finally:
        await dispatcher.stop()
        await redis.aclose()
        await reader.aclose()
