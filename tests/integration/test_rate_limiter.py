"""Triton's rate limiter (``--rate-limit=execution_count``) on a real stack: two models whose
instances need the one copy of a resource never compute at once (the second waits, its wait
counted as queue time), while a model that lists no resources is not held up."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
from redis import Redis

from sluice.core.keys import Keys
from sluice.scheduler.executor.redis_server import RedisServer
from tests.support.gate_model import BLOCKER_ITERS, open_gate, write_gate
from tests.support.load import slow_request
from tests.support.procs import wait_until
from tests.support.stack import Stack

NEEDS_R = 'rate_limiter { resources [ { name: "R" count: 1 } ] priority: 1 }'


def _stats(http: httpx.Client, model: str) -> dict[str, Any]:
    stats: dict[str, Any] = http.get(f"/v2/models/{model}/stats").json()["model_stats"][0]
    return stats


def _holders(client: Redis, namespace: str) -> int:
    """Batches holding rate limiter resources now."""
    return sum(
        sum(1 for field in client.hkeys(key) if field.startswith(b"h:"))
        for key in client.scan_iter(match=f"{namespace}:{{rate-limiter}}:*")
    )


def test_instances_sharing_a_resource_take_turns(tmp_path: Path, redis_server: RedisServer) -> None:
    repository, gate = tmp_path / "repository", tmp_path / "gate"
    gate.mkdir()
    write_gate(repository, "first", instance_extra=NEEDS_R)
    write_gate(repository, "second", instance_extra=NEEDS_R)
    write_gate(repository, "free")
    stack = Stack(
        repository,
        redis_server.url,
        grpc_port=0,
        env={"SLUICE_TEST_GATE": str(gate)},
        args=["--rate-limit=execution_count", "--rate-limit-resource=R:1"],
    )
    stack.start()
    client = Redis.from_url(redis_server.url)
    answered: dict[str, float] = {}

    def send(model: str, iters: int) -> threading.Thread:
        def post() -> None:
            with httpx.Client(base_url=stack.url, timeout=120) as http:
                response = http.post(
                    f"/v2/models/{model}/infer", content=orjson.dumps(slow_request(1, iters))
                )
            assert response.status_code == 200, response.text
            answered[model] = time.monotonic()

        thread = threading.Thread(target=post, daemon=True)
        thread.start()
        return thread

    try:
        with httpx.Client(base_url=stack.url, timeout=30) as http:
            first = send("first", BLOCKER_ITERS)  # holds R until its gate opens
            assert wait_until(lambda: _holders(client, stack.namespace) == 1, 60)
            second = send("second", 1)
            free = send("free", 1)
            free.join(60)
            assert "free" in answered  # a model without resources is not held up
            # Queued (its wait from then on is counted), then held a second at least.
            queued = Keys(stack.namespace).request_stream("second", 1)
            assert wait_until(lambda: client.xlen(queued) >= 1, 30), "second never queued"
            time.sleep(1.0)
            assert "second" not in answered  # R's one copy is held by the first
            opened = time.monotonic()
            open_gate(gate, "first")
            first.join(60)
            second.join(60)
            assert answered["second"] >= opened
            queue_ns = _stats(http, "second")["inference_stats"]["queue"]["ns"]
            assert queue_ns >= 0.9e9  # its wait for R counts as queue time
        assert wait_until(lambda: _holders(client, stack.namespace) == 0, 10)
    finally:
        open_gate(gate, "first")
        client.close()
        stack.stop()
