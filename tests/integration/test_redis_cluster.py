"""Sluice on a real Redis Cluster (3 primaries, 3 replicas, started by the tests):
``SLUICE_REDIS_URL=redis+cluster://…`` and everything a user does on one Redis works the
same: inference over HTTP and gRPC, a stateful sequence, an asynchronous job, statistics
and metrics; batch jobs without a plain broker are refused with the setting to use."""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from redis import Redis

from sluice.core.keys import Keys
from sluice.core.redis_client.connect import connect, connect_async
from sluice.core.settings import GatewaySettings
from tests.support.load import answer_matches, slow_request
from tests.support.redis_cluster import LocalRedisCluster
from tests.support.slow_model import write_slow
from tests.support.stack import Stack

pytestmark = pytest.mark.cluster

EXAMPLES = Path(__file__).resolve().parents[2] / "model_repository"


@pytest.fixture(scope="module")
def cluster_stack(
    tmp_path_factory: pytest.TempPathFactory, redis_cluster: LocalRedisCluster
) -> Iterator[Stack]:
    repository = tmp_path_factory.mktemp("cluster-repo")
    write_slow(repository, "slow", extra="dynamic_batching { max_queue_delay_microseconds: 500 }")
    shutil.copytree(EXAMPLES / "accumulator", repository / "accumulator")
    stack = Stack(repository, redis_cluster.url)
    stack.start()
    yield stack
    stack.stop()


def test_inference_over_http_and_grpc(cluster_stack: Stack) -> None:
    with httpx.Client(base_url=cluster_stack.url, timeout=30) as http:
        for index in range(20):
            response = http.post("/v2/models/slow/infer", json=slow_request(index))
            assert response.status_code == 200, response.text
            assert answer_matches(index, response.json())
    client = grpcclient.InferenceServerClient(cluster_stack.grpc_address)
    try:
        values = np.arange(8, dtype=np.float32).reshape(2, 4)
        inputs = [
            grpcclient.InferInput("IN", [2, 4], "FP32"),
            grpcclient.InferInput("ITERS", [2, 1], "INT64"),
        ]
        inputs[0].set_data_from_numpy(values)
        inputs[1].set_data_from_numpy(np.zeros((2, 1), dtype=np.int64))
        result = client.infer("slow", inputs)
        np.testing.assert_array_equal(result.as_numpy("OUT"), values)
        assert client.is_server_ready()
    finally:
        client.close()


def test_sequence_keeps_its_state(cluster_stack: Stack) -> None:
    totals = []
    with httpx.Client(base_url=cluster_stack.url, timeout=30) as http:
        for step, value in enumerate([1.0, 2.0, 4.0]):
            parameters: dict[str, object] = {"sequence_id": 42}
            if step == 0:
                parameters["sequence_start"] = True
            if step == 2:
                parameters["sequence_end"] = True
            body = {
                "parameters": parameters,
                "inputs": [{"name": "INPUT", "datatype": "FP32", "shape": [1, 1], "data": [value]}],
            }
            response = http.post("/v2/models/accumulator/infer", json=body)
            assert response.status_code == 200, response.text
            totals.append(response.json()["outputs"][0]["data"][0])
    assert totals == [1.0, 3.0, 7.0]


def test_asynchronous_job_completes(cluster_stack: Stack) -> None:
    with httpx.Client(base_url=cluster_stack.url, timeout=30) as http:
        submitted = http.post(
            "/v2/models/slow/infer", json=slow_request(7), headers={"Prefer": "respond-async"}
        )
        assert submitted.status_code == 202, submitted.text
        job = submitted.json()["id"]
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            status = http.get(f"/v2/jobs/{job}").json()["status"]
            if status == "completed":
                break
            time.sleep(0.1)
        assert status == "completed"
        result = http.get(f"/v2/jobs/{job}/result")
        assert result.status_code == 200, result.text
        assert answer_matches(7, result.json())
        assert http.get(f"/v2/jobs/{'0' * 32}").status_code == 404


def test_statistics_and_metrics(cluster_stack: Stack) -> None:
    with httpx.Client(base_url=cluster_stack.url, timeout=30) as http:
        assert http.post("/v2/models/slow/infer", json=slow_request(1)).status_code == 200
        stats = http.get("/v2/models/slow/stats").json()["model_stats"][0]
        assert stats["inference_stats"]["success"]["count"] >= 1
        metrics = http.get("/metrics")
        assert metrics.status_code == 200
        assert 'nv_inference_request_success{model="slow",version="1"}' in metrics.text


def test_batch_jobs_need_a_plain_broker(cluster_stack: Stack) -> None:
    with httpx.Client(base_url=cluster_stack.url, timeout=30) as http:
        response = http.post(
            "/v2/batches", json={"model": "slow", "input": "in.jsonl", "output": "out"}
        )
    assert response.status_code == 501, response.text
    assert "SLUICE_BATCH_BROKER_URL" in response.json()["error"]


def test_a_models_keys_share_one_slot(
    cluster_stack: Stack, redis_cluster: LocalRedisCluster
) -> None:
    """What the workers wrote for a model lives on one shard: its stream, statistics,
    live workers and sequence streams all hash to the same slot."""
    keys = Keys(cluster_stack.namespace)
    client = connect(redis_cluster.url)
    try:
        written = [
            keys.request_stream("slow", 1),
            keys.stats("slow", 1),
            keys.live_workers("slow", 1),
            keys.sequence_stream("accumulator", 1, 0),
        ]
        assert all(client.exists(key) for key in written)
        for model_keys in (written[:3], written[3:]):
            node = redis_cluster.primary_of(model_keys[0])
            plain = Redis(host="127.0.0.1", port=node.port)
            assert all(plain.exists(key) for key in model_keys)  # no MOVED: one node has all
            plain.close()
    finally:
        client.close()


def test_stream_reads_route_without_asking_a_node(redis_cluster: LocalRedisCluster) -> None:
    """XREAD and XREADGROUP name their streams after ``STREAMS``: the client reads their
    slot from there rather than asking a node (``COMMAND GETKEYS``), a round trip per
    read that failed from inside redis-py while that node failed over."""
    streams = ["{fair}:req:a", "{fair}:req:a:t:team"]

    def no_asking(*_args: object) -> None:
        raise AssertionError("asked a node for the keys of a stream read")

    client = connect(redis_cluster.url)
    try:
        for stream in streams:
            client.xadd(stream, {"n": "1"})
            client.xgroup_create(stream, "workers", id="0")
        client.commands_parser.get_keys = no_asking  # type: ignore[attr-defined]
        read = client.xreadgroup("workers", "w1", dict.fromkeys(streams, ">"), count=4)
        assert sorted(name.decode() for name, _ in read) == sorted(streams)  # type: ignore[union-attr]
        assert len(client.xread(dict.fromkeys(streams, "0"))) == 2  # type: ignore[arg-type]

        async def read_async() -> int:
            aclient = connect_async(redis_cluster.url)
            try:
                await aclient.xadd(streams[0], {"n": "2"})
                aclient.commands_parser.get_keys = no_asking  # type: ignore[attr-defined]
                found = await aclient.xreadgroup("workers", "w2", dict.fromkeys(streams, ">"))
                return len(found)
            finally:
                await aclient.aclose()

        assert asyncio.run(read_async()) == 1
    finally:
        client.delete(*streams)
        client.close()


def test_the_response_cache_works_on_a_cluster(redis_cluster: LocalRedisCluster) -> None:
    """Each script touches one slot (its shard's own: 16 shards by default on a cluster,
    spread over the nodes), its scripts are loaded on every primary, and its pipelines mix
    the shards with a model's statistics."""
    from sluice.core.observability.statistics import count_field
    from sluice.core.response_cache import ResponseCache, pack_answer
    from sluice.core.wire import ReplyMessage, TensorHeader

    keys = Keys(f"cache{time.monotonic_ns()}")
    reply = ReplyMessage("k", 1, [TensorHeader("OUT", "UINT8", (1, 4), 4)])

    async def main() -> tuple[bool, bytes | None, bytes | None]:
        client = connect_async(redis_cluster.url)
        try:
            settings = GatewaySettings(response_cache_bytes=1 << 20)
            cache = ResponseCache.from_settings(client, keys, settings, redis_cluster.url)
            assert cache is not None and cache.shards == 16
            others = [f"{n:08x}" for n in range(1, 16)]  # (one in each other shard)
            stored = [pack_answer(reply, bytes([n] * 4)) for n in range(1, 16)]
            kept_all = await asyncio.gather(
                cache.put("a", pack_answer(reply, b"\x01\x02\x03\x04")),
                *(cache.put(key, value) for key, value in zip(others, stored, strict=True)),
            )
            kept = all(kept_all)
            found, _, *rest = await asyncio.gather(
                cache.get("a"),
                cache.count(keys.stats("m", 1), hit=True, elapsed_ns=10, lookup_ns=5),
                *(cache.get(key) for key in others),
            )
            assert all(bytes(hit[1]) == bytes([n] * 4) for n, hit in enumerate(rest, 1) if hit)
            assert all(rest), "an answer of another shard was lost"
            hits = cast(
                bytes | None, await client.hget(keys.stats("m", 1), count_field("cache_hit"))
            )
            return kept, bytes(found[1]) if found else None, hits
        finally:
            await client.aclose()

    kept, data, hits = asyncio.run(main())
    assert (kept, data, hits) == (True, b"\x01\x02\x03\x04", b"1")
