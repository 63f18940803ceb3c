"""Client shared memory regions shared by the gateway processes of a host
(:mod:`sluice.gateway.shm.store`): two registries over one store and one host counter stand
for two processes; the Redis store on a real redis-server; ``--gateway-processes auto``."""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import cast

import httpx
import numpy as np
import pytest
from pydantic import ValidationError
from redis.asyncio import Redis
from typer.testing import CliRunner

from sluice.cli import app
from sluice.core.errors import InvalidInput, NotFound, QuotaExceeded
from sluice.core.keys import Keys
from sluice.core.settings import GatewaySettings, UpSettings, auto_gateway_processes
from sluice.core.shm import SHM_DIR
from sluice.core.tenants import CURRENT_TENANT
from sluice.core.wire import ShmRef
from sluice.gateway.shm.cuda import CudaRegion
from sluice.gateway.shm.registry import RegionMiss, RegionRegistry, RegionsChanged
from sluice.gateway.shm.store import (
    HostCounter,
    MemoryRegionStore,
    RedisRegionStore,
    RegionLimits,
    RegionStore,
)
from sluice.scheduler.executor.redis_server import RedisServer
from tests.support.onnx_models import identity_config
from tests.unit.gateway.in_process import EchoDispatcher, in_process_gateway


@pytest.fixture
def shm_key() -> Iterator[str]:
    """A 4 KiB POSIX shm object of this test's own."""
    name = f"shmtest-shared-{uuid.uuid4().hex[:12]}"
    path = SHM_DIR / name
    path.write_bytes(b"\0" * 4096)
    yield "/" + name
    path.unlink(missing_ok=True)


@pytest.fixture
async def redis(redis_server: RedisServer) -> AsyncIterator[Redis]:
    """A client of the tests' redis-server, emptied first (each test starts with no regions)."""
    client = Redis.from_url(redis_server.url)
    await client.flushall()
    yield client
    await client.aclose()


def pair(
    store: RegionStore, directory: Path, max_regions: int = 1024, tenant_max_regions: int = 256
) -> list[RegionRegistry]:
    """Two gateway processes of one host: one store, one counter file."""
    return [
        RegionRegistry(
            store=store,
            counter=HostCounter("t", "host", directory),
            max_regions=max_regions,
            tenant_max_regions=tenant_max_regions,
        )
        for _ in range(2)
    ]


async def _shared_life(store: RegionStore, directory: Path, key: str) -> None:
    one, two = pair(store, directory)
    await one.catch_up()
    await two.catch_up()
    await one.register_system("r", key, 1024, 2048)
    # The other process notices at its next use (the counter moved) and catches up.
    with pytest.raises(RegionsChanged):
        two.resolve("input 'x'", "r", 0, 4)
    assert await two.catch_up()
    assert two.resolve("input 'x'", "r", 16, 4) == ShmRef(key, 1040, 4)
    assert await two.system_status("r") == [
        {"name": "r", "key": key, "offset": 1024, "byte_size": 2048}
    ]
    assert not await two.catch_up()  # nothing changed since
    # A name taken through one process is taken for the other.
    with pytest.raises(InvalidInput, match=r"^shared memory region 'r' already in manager$"):
        await two.register_system("r", key, 0, 8)
    # Unregistered through the other: refused everywhere from now on.
    await two.unregister_system("r")
    with pytest.raises(RegionsChanged):
        one.resolve("input 'x'", "r", 0, 4)
    await one.catch_up()
    with pytest.raises(RegionMiss, match="unknown shared memory region 'r'"):
        one.resolve("input 'x'", "r", 0, 4)
    with pytest.raises(NotFound):
        await one.system_status("r")
    # Registered anew with other bounds: the new ones hold in both.
    await two.register_system("r", key, 0, 64)
    await one.catch_up()
    assert one.resolve("input 'x'", "r", 0, 64) == ShmRef(key, 0, 64)
    await one.unregister_system(None)
    assert await two.system_status(None) == []


async def test_a_region_registered_in_one_process_is_served_by_another(
    tmp_path: Path, shm_key: str
) -> None:
    await _shared_life(MemoryRegionStore(), tmp_path, shm_key)


async def test_the_records_live_in_redis_per_host(
    tmp_path: Path, shm_key: str, redis: Redis
) -> None:
    keys = Keys(f"t{uuid.uuid4().hex[:6]}")
    await _shared_life(RedisRegionStore(redis, keys, "host-a", ttl_s=30), tmp_path, shm_key)
    store = RedisRegionStore(redis, keys, "host-a", ttl_s=30)
    record = b'{"key": "/k", "offset": 0, "byte_size": 8}'
    await store.add("system", "anonymous/kept", record, RegionLimits(10, 10))
    assert await redis.pttl(keys.client_regions("host-a", "system")) > 0  # expires unless renewed
    loaded = await store.load(None)
    assert loaded is not None and set(loaded.system) == {"anonymous/kept"}
    assert await store.load(loaded.revision) is None  # one cheap answer while nothing changed
    elsewhere = await RedisRegionStore(redis, keys, "host-b").load(None)
    assert elsewhere is not None and elsewhere.system == {}  # another host's are its own


async def test_a_changed_region_reaches_a_process_without_the_counter(
    tmp_path: Path, shm_key: str
) -> None:
    """No /dev/shm counter (it could not be made): a miss asks the store; the refresh does."""
    store = MemoryRegionStore()
    one = RegionRegistry(store=store)
    two = RegionRegistry(store=store, counter=HostCounter("t", "h", tmp_path / "missing"))
    await one.register_system("r", shm_key, 0, 64)
    with pytest.raises(RegionMiss):
        two.resolve("input 'x'", "r", 0, 4)
    assert await two.catch_up()
    assert two.resolve("input 'x'", "r", 0, 4) == ShmRef(shm_key, 0, 4)


async def test_a_miss_seen_after_the_refresh_caught_up_is_parsed_again(
    tmp_path: Path, shm_key: str
) -> None:
    one, two = pair(MemoryRegionStore(), tmp_path)
    await one.register_system("r", shm_key, 0, 64)
    with pytest.raises(RegionsChanged) as miss:
        two.resolve("input 'x'", "r", 0, 4)
    await two.catch_up()  # the catalog refresh got there first
    assert await two.recover(miss.value)
    assert two.resolve("input 'x'", "r", 0, 4) == ShmRef(shm_key, 0, 4)
    with pytest.raises(RegionMiss) as unknown:
        two.resolve("input 'x'", "q", 0, 4)
    assert not await two.recover(unknown.value)  # nothing to find: the 400 stands


async def test_an_inference_request_names_a_region_registered_elsewhere(
    tmp_path: Path, shm_key: str
) -> None:
    """Through the REST route: the gateway process catches up before it parses again."""
    fast = in_process_gateway(
        "echo", identity_config("echo", ["FP32"], [-1], 8), EchoDispatcher(["OUT_FP32"])
    )
    store = MemoryRegionStore()
    elsewhere, here = pair(store, tmp_path)
    fast.app.state.sluice.regions = here
    fast.app.state.sluice.transfer.regions = here
    values = np.arange(4, dtype=np.float32)
    (SHM_DIR / shm_key[1:]).write_bytes(values.tobytes())
    await elsewhere.register_system("r", shm_key, 0, 16)
    body = {
        "inputs": [
            {
                "name": "IN_FP32",
                "datatype": "FP32",
                "shape": [1, 4],
                "parameters": {"shared_memory_region": "r", "shared_memory_byte_size": 16},
            }
        ]
    }
    transport = httpx.ASGITransport(app=fast)
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
        answer = await client.post("/v2/models/echo/infer", json=body)
        assert answer.status_code == 200, answer.text
        assert answer.json()["outputs"][0]["data"] == values.tolist()
        await elsewhere.unregister_system("r")
        refused = await client.post("/v2/models/echo/infer", json=body)
        assert refused.status_code == 400
        assert "unknown shared memory region 'r'" in refused.json()["error"]


async def test_the_number_of_regions_is_bounded_per_host(tmp_path: Path, shm_key: str) -> None:
    one, two = pair(MemoryRegionStore(), tmp_path, max_regions=2)
    await one.register_system("a", shm_key, 0, 8)
    await two.register_system("b", shm_key, 0, 8)
    with pytest.raises(QuotaExceeded, match="SLUICE_MAX_SHM_REGIONS") as info:
        await one.register_system("c", shm_key, 0, 8)
    assert info.value.status == 429
    assert "failed to register shared memory region 'c'" in info.value.message
    await two.unregister_system("a")
    await one.register_system("c", shm_key, 0, 8)


@contextlib.contextmanager
def tenant(name: str) -> Iterator[None]:
    """Calls made as tenant ``name`` (as the key checks set it for a request)."""
    token = CURRENT_TENANT.set(name)
    try:
        yield
    finally:
        CURRENT_TENANT.reset(token)


def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA handles that open and close without a GPU (a stand-in for cuda-python)."""

    def open_region(name: str, raw_handle: bytes, device_id: int, byte_size: int) -> CudaRegion:
        return CudaRegion(name, device_id, byte_size, 1000)

    monkeypatch.setattr("sluice.gateway.shm.registry.open_cuda_region", open_region)
    monkeypatch.setattr("sluice.gateway.shm.registry.close_cuda_region", lambda region: None)


async def _bounded_per_tenant(store: RegionStore, directory: Path, key: str) -> None:
    one, two = pair(store, directory, max_regions=5, tenant_max_regions=2)
    with tenant("team-a"):
        await one.register_system("a1", key, 0, 8)
        await two.register_system("a2", key, 0, 8)
        # Before, team-a could take every place of the host and leave none to the others.
        with pytest.raises(QuotaExceeded, match="SLUICE_TENANT_MAX_SHM_REGIONS") as info:
            await one.register_system("a3", key, 0, 8)
        assert info.value.status == 429
        assert info.value.message.startswith("failed to register shared memory region 'a3': ")
        assert "tenant 'team-a' has 2 regions registered on this host already" in (
            info.value.message
        )
    with tenant("team-b"):
        await two.register_system("b1", key, 0, 8)
        await one.register_cuda("b2", b"\x01" * 64, 0, 8)  # (system and CUDA count together)
        with pytest.raises(QuotaExceeded, match="SLUICE_TENANT_MAX_SHM_REGIONS"):
            await two.register_system("b3", key, 0, 8)
        with pytest.raises(QuotaExceeded, match="SLUICE_TENANT_MAX_SHM_REGIONS"):
            await two.register_cuda("b3", b"\x01" * 64, 0, 8)
    with tenant("team-c"):
        await one.register_system("c1", key, 0, 8)
        # The host's bound still holds, whatever the tenants' own.
        with pytest.raises(QuotaExceeded, match="SLUICE_MAX_SHM_REGIONS") as host:
            await two.register_system("c2", key, 0, 8)
        assert "SLUICE_TENANT_MAX_SHM_REGIONS" not in host.value.message
    with tenant("team-a"):
        await two.unregister_system("a1")
        await one.register_system("a3", key, 0, 8)  # a place of its own again
        assert sorted(row["name"] for row in await two.system_status(None)) == ["a2", "a3"]


async def test_the_number_of_regions_is_bounded_per_tenant(
    tmp_path: Path, shm_key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_cuda(monkeypatch)
    await _bounded_per_tenant(MemoryRegionStore(), tmp_path, shm_key)


async def test_the_number_of_regions_is_bounded_per_tenant_in_redis(
    tmp_path: Path, shm_key: str, redis: Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_cuda(monkeypatch)
    keys = Keys(f"t{uuid.uuid4().hex[:6]}")
    await _bounded_per_tenant(RedisRegionStore(redis, keys, "host-a", ttl_s=30), tmp_path, shm_key)


async def test_a_tenants_bound_holds_across_processes_registering_at_once(
    tmp_path: Path, shm_key: str, redis_server: RedisServer
) -> None:
    """Two gateway processes (each its own Redis connection) register a dozen regions of one
    tenant at once: the bound is checked where the region is added, so no more pass."""
    keys = Keys(f"t{uuid.uuid4().hex[:6]}")
    clients = [Redis.from_url(redis_server.url) for _ in range(2)]
    try:
        one, two = (
            RegionRegistry(
                store=RedisRegionStore(client, keys, "host-a", ttl_s=30),
                counter=HostCounter("t", "host", tmp_path),
                tenant_max_regions=3,
            )
            for client in clients
        )
        with tenant("team-a"):
            names = [f"r{i}" for i in range(12)]
            outcomes = await asyncio.gather(
                *(
                    (one if i % 2 else two).register_system(name, shm_key, 0, 8)
                    for i, name in enumerate(names)
                ),
                return_exceptions=True,
            )
            refused = [o for o in outcomes if isinstance(o, QuotaExceeded)]
            assert len(refused) == 9 and outcomes.count(None) == 3, outcomes
            assert len(await one.system_status(None)) == 3
        stored = cast(list[bytes], await clients[0].hkeys(keys.client_regions("host-a", "system")))
        assert len(stored) == 3 and all(name.startswith(b"team-a/") for name in stored)
    finally:
        for client in clients:
            await client.aclose()


async def test_records_of_no_tenant_are_removed_and_free_their_places(
    tmp_path: Path, shm_key: str, redis: Redis
) -> None:
    """Records written before regions belonged to tenants (``<name>`` without a ``<tenant>/``)
    were nobody's: invisible, unusable, never unregistered, and counted against the host's
    bound for as long as a gateway of the host renewed the records."""
    keys = Keys(f"t{uuid.uuid4().hex[:6]}")
    system, cuda = keys.client_regions("host-a", "system"), keys.client_regions("host-a", "cuda")
    record = b'{"key": "/old", "offset": 0, "byte_size": 8}'
    await redis.hset(system, mapping={"old1": record, "old2": record})
    await redis.hset(cuda, "oldgpu", b'{"raw_handle": "AQ==", "device_id": 0, "byte_size": 8}')
    await redis.hset(keys.client_regions_draining("host-a"), "old1", "1")
    await redis.zadd(keys.client_region_users("host-a", "old1"), {"lease": 2**50})
    await redis.incr(keys.client_regions_revision("host-a"))
    store = RedisRegionStore(redis, keys, "host-a", ttl_s=30)
    one, two = pair(store, tmp_path, max_regions=3)
    # A gateway process that starts loads the records, and removes them.
    assert await one.catch_up()
    assert await redis.hgetall(system) == {} and await redis.hgetall(cuda) == {}
    assert not await redis.exists(
        keys.client_regions_draining("host-a"), keys.client_region_users("host-a", "old1")
    )
    for name in ("a", "b", "c"):  # the host's three places are free again
        await one.register_system(name, shm_key, 0, 8)
    await two.catch_up()
    assert [row["name"] for row in await two.system_status(None)] == ["a", "b", "c"]
    # One written by a process of the old kind meanwhile goes at the next load.
    await one.unregister_system("c")
    await redis.hset(system, "late", record)
    await redis.incr(keys.client_regions_revision("host-a"))
    assert await two.catch_up()
    assert sorted(await redis.hkeys(system)) == [b"anonymous/a", b"anonymous/b"]
    await two.register_system("c", shm_key, 0, 8)
    assert "late" not in two.records.system


async def _tenants_apart(store: RegionStore, directory: Path, key: str) -> None:
    one, two = pair(store, directory)
    with tenant("team-a"):
        await one.register_system("r", key, 0, 64)
        await one.register_system("kept", key, 0, 64)
    await two.catch_up()
    with tenant("team-b"):
        # Another tenant's region is an unknown one: not listed, not usable, its name free.
        assert await two.system_status(None) == []
        with pytest.raises(NotFound, match="Unable to find system shared memory region: 'r'"):
            await two.system_status("r")
        with pytest.raises(RegionMiss, match="unknown shared memory region 'r'"):
            two.resolve("input 'x'", "r", 0, 4)
        with pytest.raises(RegionMiss, match="unknown shared memory region 'r'"):
            two.resolve("output 'y'", "r", 0, 4, output=True)
        await two.register_system("r", key, 32, 16)
        assert two.resolve("input 'x'", "r", 0, 16) == ShmRef(key, 32, 16)
        await two.unregister_system("kept")  # (none of its own: nothing happens)
        await two.unregister_system(None)  # all of its own, none of team-a's
        assert await two.system_status(None) == []
    await one.catch_up()
    with tenant("team-a"):
        assert sorted(row["name"] for row in await one.system_status(None)) == ["kept", "r"]
        assert one.resolve("input 'x'", "r", 0, 64) == ShmRef(key, 0, 64)
        await one.unregister_system(None)
        assert await one.system_status(None) == []


async def test_regions_belong_to_the_tenant_that_registered_them(
    tmp_path: Path, shm_key: str
) -> None:
    await _tenants_apart(MemoryRegionStore(), tmp_path, shm_key)


async def test_regions_belong_to_their_tenant_in_redis(
    tmp_path: Path, shm_key: str, redis: Redis
) -> None:
    keys = Keys(f"t{uuid.uuid4().hex[:6]}")
    await _tenants_apart(RedisRegionStore(redis, keys, "host-a", ttl_s=30), tmp_path, shm_key)
    assert await redis.hgetall(keys.client_regions("host-a", "system")) == {}


@pytest.mark.parametrize("name", ["", "x" * 256, "é" * 128])
async def test_a_region_name_is_bounded(tmp_path: Path, shm_key: str, name: str) -> None:
    """gRPC takes any string (REST, one path segment): a region's name is kept by every
    process and listed in every status, so it has 1 to 255 bytes."""
    one, _ = pair(MemoryRegionStore(), tmp_path)
    with pytest.raises(InvalidInput, match="a region name has 1 to 255 bytes"):
        await one.register_system(name, shm_key, 0, 8)
    with pytest.raises(InvalidInput, match="a region name has 1 to 255 bytes"):
        await one.register_cuda(name, b"\x01" * 64, 0, 8)
    assert await one.system_status(None) == []
    await one.register_system("x" * 255, shm_key, 0, 8)


async def test_cuda_handles_are_opened_where_used_and_closed_everywhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stand-in for cuda-python: who opened which handle, and who closed it."""
    events: list[tuple[str, int, str]] = []
    pointers = iter(range(1000, 2000))

    def open_region(name: str, raw_handle: bytes, device_id: int, byte_size: int) -> CudaRegion:
        region = CudaRegion(name, device_id, byte_size, next(pointers))
        events.append(("open", region.pointer, name))
        return region

    def close_region(region: CudaRegion) -> None:
        events.append(("close", region.pointer, region.name))

    monkeypatch.setattr("sluice.gateway.shm.registry.open_cuda_region", open_region)
    monkeypatch.setattr("sluice.gateway.shm.registry.close_cuda_region", close_region)
    one, two = pair(MemoryRegionStore(), tmp_path)
    await one.register_cuda("gpu", b"\x01" * 64, 0, 1024)
    assert events == [("open", 1000, "gpu")]  # the registering process proves the handle
    assert await two.cuda_status(None) == [{"name": "gpu", "device_id": 0, "byte_size": 1024}]
    assert two.mapped_cuda("gpu").pointer == 1001  # opened where first needed, once
    assert two.mapped_cuda("gpu").pointer == 1001
    assert one.mapped_cuda("gpu").pointer == 1000
    with pytest.raises(InvalidInput, match="already in manager"):
        await two.register_system("gpu", "/any", 0, 8)
    with pytest.raises(InvalidInput, match="cannot carry tensors yet"):
        two.resolve("input 'x'", "gpu", 0, 4)
    await one.unregister_cuda("gpu")
    assert ("close", 1000, "gpu") in events
    await two.catch_up()
    assert ("close", 1001, "gpu") in events
    assert await two.cuda_status(None) == []
    # A process that stops closes what it opened and leaves the records to the others.
    await two.register_cuda("gpu", b"\x02" * 64, 0, 512)
    two.close_local()
    assert events[-1] == ("close", 1002, "gpu")
    assert await one.cuda_status("gpu") == [{"name": "gpu", "device_id": 0, "byte_size": 512}]


def test_the_host_counter_is_shared_and_private(tmp_path: Path) -> None:
    one, two = HostCounter("ns", "h", tmp_path), HostCounter("ns", "h", tmp_path)
    other_namespace = HostCounter("other", "h", tmp_path)
    assert one.value() == two.value() == 0
    one.bump()
    two.bump()
    assert one.value() == two.value() == 2
    assert other_namespace.value() == 0
    assert stat.S_IMODE(os.stat(one.path).st_mode) == 0o600
    assert not os.path.basename(one.path).startswith("sluice-ns-")  # no segment of the sweeper's
    for counter in (one, two, other_namespace):
        counter.close()


def test_gateway_processes_auto_follows_the_cpus_this_process_may_use(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One gateway process per two CPUs (the workers and Redis need the rest)."""
    cpus = len(os.sched_getaffinity(0))
    assert auto_gateway_processes() == max(1, min(cpus // 2, 16))
    monkeypatch.delenv("SLUICE_GATEWAY_PROCESSES", raising=False)
    assert UpSettings().gateway_processes == max(1, min(cpus // 2, 16))  # the default
    monkeypatch.setattr(os, "sched_getaffinity", lambda _: set(range(40)))
    assert UpSettings(gateway_processes="auto").gateway_processes == 16
    monkeypatch.setattr(os, "sched_getaffinity", lambda _: set(range(9)))
    assert UpSettings(gateway_processes="auto").gateway_processes == 4
    monkeypatch.setattr(os, "sched_getaffinity", lambda _: {3})
    monkeypatch.setenv("SLUICE_GATEWAY_PROCESSES", "auto")
    assert UpSettings().gateway_processes == 1
    assert GatewaySettings().gateway_processes == 1
    monkeypatch.setenv("SLUICE_GATEWAY_PROCESSES", "3")
    assert UpSettings().gateway_processes == 3


@pytest.mark.parametrize("bad", ["0", "65", "-1", "2.5", "many", ""])
def test_bad_gateway_processes_are_refused_naming_the_setting(
    bad: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SLUICE_GATEWAY_PROCESSES", bad)
    with pytest.raises(ValidationError, match="gateway_processes"):
        UpSettings()
    monkeypatch.delenv("SLUICE_GATEWAY_PROCESSES")
    result = CliRunner().invoke(app, ["up", "--gateway-processes", bad])
    assert result.exit_code == 2
    assert "--gateway-processes" in result.output


@pytest.mark.parametrize("value", ["-1", "2000000", "lots"])
def test_a_bad_region_limit_is_refused_naming_it(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv("SLUICE_MAX_SHM_REGIONS", value)
    with pytest.raises(ValidationError, match="max_shm_regions"):
        GatewaySettings()


def test_a_tenants_own_bound_applies_once_api_keys_make_tenants() -> None:
    keyless = RegionRegistry.from_settings(
        GatewaySettings(max_shm_regions=1000, tenant_max_shm_regions=10)
    )
    assert (keyless.limits.host, keyless.limits.tenant) == (1000, 1000)
    keyed = RegionRegistry.from_settings(
        GatewaySettings(max_shm_regions=1000, tenant_max_shm_regions=10, api_keys="a:k")
    )
    assert (keyed.limits.host, keyed.limits.tenant) == (1000, 10)
