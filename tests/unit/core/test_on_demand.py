"""Which models load on demand, and what the executors report of them."""

from __future__ import annotations

import orjson
import pytest
from redis import Redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from sluice.core.catalog import CatalogEntry, decode_entry, encode_entry
from sluice.core.config import ModelConfig, parse_config_text
from sluice.core.errors import InvalidConfig
from sluice.core.keys import Keys
from sluice.core.on_demand import (
    HostMemory,
    encode_state,
    host_memories,
    is_on_demand,
    version_states,
    wake_blocking,
)
from sluice.scheduler.executor.redis_server import RedisServer


def config(parameters: dict[str, str]) -> ModelConfig:
    lines = "".join(
        f'parameters {{ key: "{k}" value {{ string_value: "{v}" }} }}\n'
        for k, v in parameters.items()
    )
    return parse_config_text(f'name: "m"\nplatform: "onnxruntime_onnx"\n{lines}', model_name="m")


@pytest.mark.parametrize(
    ("parameters", "mode", "expected"),
    [
        ({}, "demand", True),
        ({"sluice.pinned": "true"}, "demand", False),
        ({"sluice.load": "always"}, "demand", False),
        ({}, "none", False),
        ({"sluice.load": "on_demand"}, "none", True),
        ({"sluice.load": "ON_DEMAND"}, "none", True),
        ({"sluice.load": "on_demand", "sluice.pinned": "yes"}, "none", False),
        ({"sluice.load": "on_demand"}, "explicit", False),
        ({"sluice.load": "on_demand"}, "poll", False),
    ],
)
def test_which_models_load_on_demand(parameters: dict[str, str], mode: str, expected: bool) -> None:
    assert is_on_demand(config(parameters), mode) is expected


def test_a_load_value_that_means_nothing_is_named() -> None:
    expected = r"sluice\.load is 'lazy'; it may be on_demand or always"
    with pytest.raises(InvalidConfig, match=expected):
        is_on_demand(config({"sluice.load": "lazy"}), "none")


def test_a_version_is_ready_where_any_live_host_serves_it() -> None:
    raw = {
        b"a/m/1": encode_state("m", 1, "LOADING", 100.0),
        b"b/m/1": encode_state("m", 1, "READY", 100.0),
        b"c/m/1": encode_state("m", 1, "LOADING", 100.0),
        b"a/n/1": encode_state("n", 1, "LOADING", 100.0),
        b"a/old/1": encode_state("old", 1, "READY", 10.0),
        b"a/bad/1": b"not json",
    }
    assert version_states(raw, now_s=50.0) == {("m", 1): "READY", ("n", 1): "LOADING"}


def test_host_reports_expire_and_bad_ones_are_skipped() -> None:
    live = HostMemory("a", {"host": 10}, {"host": 4}, 100.0)
    gone = HostMemory("b", {"host": 10}, {"host": 4}, 10.0)
    raw = {b"a": live.encode(), b"b": gone.encode(), b"c": orjson.dumps({"budget": 1})}
    assert host_memories(raw, 50.0) == [live]


def test_the_catalog_carries_whether_a_model_loads_on_demand() -> None:
    entry = CatalogEntry("m", (1,), None, None, on_demand=True)
    assert decode_entry(encode_entry(entry)).on_demand is True
    assert decode_entry(encode_entry(CatalogEntry("m", (1,), None))).on_demand is False


def test_a_batch_shard_wakes_the_executors(redis_server: RedisServer) -> None:
    """What a batch worker writes when a job's model loads on demand: the entry the
    executors' command watcher blocks on, naming the version; nothing raised without
    Redis."""
    keys = Keys("wake-test")
    client = Redis.from_url(redis_server.url)
    try:
        wake_blocking(client, keys, "m", 3)
        ((_, fields),) = client.xrange(keys.demand_requests)
        assert fields == {b"model": b"m", b"version": b"3"}
    finally:
        client.delete(keys.demand_requests)
        client.close()
    unreachable = Redis(port=1, socket_connect_timeout=0.5, retry=Retry(NoBackoff(), 0))
    wake_blocking(unreachable, keys, "m", 3)
