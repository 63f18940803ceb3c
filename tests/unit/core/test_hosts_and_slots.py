"""Beyond one machine, the parts: Redis Cluster key slots and URLs, host ids, and what a
worker does with a request whose shared memory is on another host."""

from __future__ import annotations

import re

import pytest
from pydantic import ValidationError
from redis.crc import key_slot
from redis.exceptions import RedisError

from sluice.core.errors import Unavailable
from sluice.core.hosts import host_id
from sluice.core.keys import Keys
from sluice.core.redis_client.connect import (
    ClusterUnavailable,
    connect,
    connect_async,
    is_cluster_url,
    split_url,
    stream_read_keys,
)
from sluice.core.settings import CommonSettings
from sluice.core.wire import RequestMessage, ShmRef, TensorHeader, decode_request, encode_request
from sluice.gateway.control.catalog_view import CatalogView
from sluice.scheduler.executor.redis_server import free_port
from sluice.workers import shm_io
from sluice.workers.tensors import validate
from tests.support.samples import TINY_CONFIG

CONFIG = TINY_CONFIG


def slot(key: str) -> int:
    return int(key_slot(key.encode()))


@pytest.mark.parametrize("model", ["resnet", "a:b", "odd}name", "{braced}", "x" * 128])
def test_everything_of_a_model_is_in_one_slot(model: str) -> None:
    keys = Keys("prod")
    together = [
        *keys.request_streams(model, 1, 3),
        *keys.request_streams(model, 2, 0),
        keys.background_stream(model, 1),
        keys.sequence_stream(model, 1, 4),
        keys.sequence_state(model, 1, "seq-9"),
        keys.stats(model, 1),
        keys.batch_stats(model, 2),
        keys.instance_stats(model, 1),
        keys.live_workers(model, 1),
        keys.worker_hosts(model, 1),
        keys.dead_letters(model, 1),
        keys.job(model, "0" * 32),
        keys.job_by_key(model, "team-a", "client-key{}"),
    ]
    assert len({slot(key) for key in together}) == 1, together


def test_the_control_plane_is_one_slot_and_models_spread() -> None:
    keys = Keys("prod")
    control = [
        keys.catalog,
        keys.catalog_revision,
        keys.load_errors,
        keys.control_requests,
        keys.controller_requests,
        keys.control_reply("c1"),
        keys.rollout("m"),
        keys.routing("m"),
        keys.control_mode,
        keys.gateways,
        keys.gateway_report("g1"),
        keys.gateway_counters,
        keys.controller_lease,
        keys.controller_fencing,
        keys.controller_decisions,
        keys.desired_instances,
        keys.polled_repository,
        keys.batches("team-a"),
        keys.running_batches,
        keys.tenant_running_batches("team-a"),  # (the keys of one turns script)
        keys.tenant_queued_batches("team-a"),
        keys.batch_turn_tenants,
        keys.tenant_admitting_batches("team-a"),
    ]
    assert len({slot(key) for key in control}) == 1
    batch = [keys.batch("b1"), keys.batch_shards("b1"), keys.batch_leases("b1")]
    assert len({slot(key) for key in batch}) == 1
    models = {slot(keys.request_stream(f"model-{n}", 1)) for n in range(50)}
    assert len(models) > 40  # many models land on many slots (and so on many shards)


def test_a_namespace_with_braces_is_refused() -> None:
    with pytest.raises(ValidationError, match="namespace"):
        CommonSettings(namespace="a{b}")
    assert CommonSettings(namespace="team-a.prod_1").namespace == "team-a.prod_1"


def test_cluster_urls() -> None:
    assert split_url("redis+cluster://h:7000") == ("redis://h:7000", True)
    assert split_url("rediss+cluster://u:p@h:7000") == ("rediss://u:p@h:7000", True)
    assert split_url("redis://h:6379/0") == ("redis://h:6379/0", False)
    assert is_cluster_url("REDIS+CLUSTER://h:1") and not is_cluster_url("unix:///tmp/r.sock")


def test_a_cluster_url_with_another_database_is_refused() -> None:
    from sluice.core.redis_client.connect import connect

    with pytest.raises(ValueError, match="only database 0"):
        connect("redis+cluster://127.0.0.1:1/3")


def test_a_cluster_that_cannot_serve_raises_a_redis_error() -> None:
    """redis-py's RedisClusterException is no RedisError: unless translated, a cluster without
    a reachable node (or a slot without a primary during a failover) would escape every
    handler of Redis errors and kill the process instead of answering 503."""
    url = f"redis+cluster://127.0.0.1:{free_port()}"
    with pytest.raises(ClusterUnavailable, match="Redis Cluster"):
        connect(url, socket_connect_timeout=0.2)
    assert issubclass(ClusterUnavailable, RedisError)


async def test_an_async_cluster_that_cannot_serve_raises_a_redis_error() -> None:
    client = connect_async(f"redis+cluster://127.0.0.1:{free_port()}", socket_connect_timeout=0.2)
    try:
        with pytest.raises(RedisError):
            await client.get("x")
        with pytest.raises(RedisError):
            async with client.pipeline(transaction=False) as pipe:
                pipe.get("x")
                await pipe.execute()
    finally:
        await client.aclose()


def test_host_ids() -> None:
    assert host_id("rack-7.node-2") == "rack-7.node-2"
    derived = host_id()
    assert re.fullmatch(r"[0-9a-f]{16}", derived) and derived == host_id()
    with pytest.raises(ValidationError):
        CommonSettings(host_id="has space")


def test_the_gateway_uses_shared_memory_only_when_every_worker_is_on_its_host() -> None:
    view = CatalogView(Keys("t"))
    view.hosts = {("m", 1): frozenset({"h1"}), ("m", 2): frozenset({"h1", "h2"})}
    assert view.only_on("m", 1, "h1")
    assert not view.only_on("m", 1, "h2")
    assert not view.only_on("m", 2, "h1")  # one worker elsewhere: everything inline
    assert not view.only_on("m", 3, "h1")  # no worker known


def test_the_host_travels_in_the_entry() -> None:
    message = RequestMessage("k", "r", [TensorHeader("x", "FP32", (1, 2), 8)], ["y"], host="h1")
    decoded, _ = decode_request(encode_request(message, bytes(8)))
    assert decoded.host == "h1"
    plain, _ = decode_request(encode_request(RequestMessage("k", "r", [], ["y"]), b""))
    assert plain.host == ""


def test_a_worker_on_another_host_refuses_references_and_answers_inline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(shm_io.MAPPINGS, "host", "worker-host")
    by_reference = RequestMessage(
        "k",
        "r",
        [TensorHeader("x", "FP32", (1, 4), 16, ShmRef("sluice-t-1-in-x", 0, 16))],
        ["y"],
        host="gateway-host",
    )
    with pytest.raises(Unavailable, match=r"shared memory on host 'gateway-host'.*retry"):
        validate(by_reference, CONFIG)
    inline = RequestMessage(
        "k",
        "r",
        [TensorHeader("x", "FP32", (1, 4), 16)],
        ["y"],
        segment_prefix="sluice-t-",
        segment_min_bytes=1024,
        host="gateway-host",
    )
    validate(inline, CONFIG)
    assert (inline.segment_prefix, inline.segment_min_bytes) == ("", 0)
    same = RequestMessage(
        "k",
        "r",
        [TensorHeader("x", "FP32", (1, 4), 16)],
        ["y"],
        segment_prefix="sluice-t-",
        segment_min_bytes=1024,
        host="worker-host",
    )
    validate(same, CONFIG)
    assert same.segment_prefix == "sluice-t-"


def test_the_keys_of_a_stream_read() -> None:
    group_read = ("GROUP", "g", "c", "COUNT", 8, "BLOCK", 5, "STREAMS", "s1", b"s2", ">", ">")
    assert stream_read_keys(group_read) == ["s1", b"s2"]
    assert stream_read_keys((b"COUNT", 1, b"streams", "s", "0")) == ["s"]
    assert stream_read_keys(("COUNT", 1)) is None
    assert stream_read_keys(("STREAMS",)) is None
