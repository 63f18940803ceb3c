"""Client regions that requests in flight use (:mod:`sluice.gateway.shm.leases`): as in
Triton, unregistering one answers at once, but it stays listed, usable and its name taken
until the last request using it ends; a request's deadline bounds the wait. Two registries
over one store and one host counter stand for two gateway processes; each store (in memory,
and in a real redis-server) runs on a clock the test moves."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncGenerator, Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from redis.asyncio import Redis

from sluice.core.dispatch import Reply
from sluice.core.errors import InvalidInput, NotFound
from sluice.core.keys import Keys
from sluice.core.shm import SHM_DIR
from sluice.core.wire import RequestMessage, ShmRef
from sluice.gateway.inference.request import InferRequest, InputTensor, RequestedOutput
from sluice.gateway.shm.leases import holding_regions_stream, region_uses, regions_held
from sluice.gateway.shm.registry import RegionRegistry, RegionUse
from sluice.gateway.shm.store import HostCounter, MemoryRegionStore, RedisRegionStore, RegionStore
from sluice.gateway.state import GatewayState
from tests.support.onnx_models import identity_config
from tests.unit.gateway.in_process import EchoDispatcher, in_process_gateway

HOST = "host-a"


class Clock:
    """The deployment's time in ms, as the test sets it."""

    def __init__(self) -> None:
        self.ms = 1_700_000_000_000

    def __call__(self) -> int:
        return self.ms


@pytest.fixture
def shm_key() -> Iterator[str]:
    """A 4 KiB POSIX shm object of this test's own."""
    name = f"shmtest-leases-{uuid.uuid4().hex[:12]}"
    path = SHM_DIR / name
    path.write_bytes(b"\0" * 4096)
    yield "/" + name
    path.unlink(missing_ok=True)


@pytest.fixture
def keys() -> Keys:
    return Keys(f"t{uuid.uuid4().hex[:8]}")


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture(params=["memory", "redis"])
def store(request: pytest.FixtureRequest, clock: Clock, keys: Keys) -> RegionStore:
    if request.param == "memory":
        return MemoryRegionStore(clock=clock)
    redis: Redis = request.getfixturevalue("redis")
    return RedisRegionStore(redis, keys, HOST, ttl_s=30, clock=clock)


def pair(store: RegionStore, directory: Path) -> list[RegionRegistry]:
    """Two gateway processes of one host: one store, one counter file."""
    return [RegionRegistry(store=store, counter=HostCounter("t", "h", directory)) for _ in range(2)]


async def use(registry: RegionRegistry, name: str, offset: int = 0, size: int = 16) -> RegionUse:
    """What a request naming ``size`` bytes at ``offset`` of region ``name`` resolved."""
    await registry.catch_up()
    return RegionUse("input 'x'", name, registry.resolve("input 'x'", name, offset, size))


async def listed(registry: RegionRegistry) -> list[str]:
    return [row["name"] for row in await registry.system_status(None)]


# -- the bookkeeping -------------------------------------------------------------------


async def test_a_region_in_use_stays_until_the_last_request_using_it_ends(
    store: RegionStore, tmp_path: Path, shm_key: str
) -> None:
    one, two = pair(store, tmp_path)
    await one.register_system("r", shm_key, 0, 64)
    first = await one.hold([await use(one, "r")], timeout_s=30)
    assert first is not None

    await two.unregister_system("r")  # (through the other process: it answers at once)
    row = {"name": "r", "key": shm_key, "offset": 0, "byte_size": 64}
    assert await two.system_status("r") == [row]
    assert await one.system_status(None) == [row]
    # A new request may still use it, through either process...
    second = await two.hold([await use(two, "r", offset=16)], timeout_s=30)
    assert second is not None
    # ...but its name is not free.
    with pytest.raises(InvalidInput) as taken:
        await one.register_system("r", shm_key, 0, 8)
    assert taken.value.message.startswith("shared memory region 'r' already in manager; ")
    assert "unregistered while requests in flight used it" in taken.value.message

    await one.release(first)
    assert await listed(two) == ["r"]  # the second still runs
    await two.release(second)
    for registry in (one, two):
        assert await listed(registry) == []
        with pytest.raises(NotFound, match="Unable to find system shared memory region: 'r'"):
            await registry.system_status("r")
    await one.register_system("r", shm_key, 0, 8)  # the name is free again
    assert await listed(two) == ["r"]


async def test_a_region_nobody_uses_goes_at_once(
    store: RegionStore, tmp_path: Path, shm_key: str
) -> None:
    one, two = pair(store, tmp_path)
    for name in ("busy", "idle", "done"):
        await one.register_system(name, shm_key, 0, 64)
    busy = await one.hold([await use(one, "busy")], timeout_s=30)
    done = await one.hold([await use(one, "done")], timeout_s=30)
    assert busy is not None and done is not None
    await one.release(done)  # ended before the unregister: no hold left on it
    await two.unregister_system(None)
    assert await listed(one) == ["busy"]
    await two.unregister_system(None)  # again, while it drains: no error, no change
    assert await listed(one) == ["busy"]
    await one.release(busy)
    assert await listed(two) == []


async def test_a_lease_lapses_at_the_request_deadline(
    store: RegionStore, clock: Clock, tmp_path: Path, shm_key: str
) -> None:
    """The request never ends (its gateway process died): the region goes at its deadline,
    at the next load of the records (each catalog refresh makes one)."""
    one, two = pair(store, tmp_path)
    await one.register_system("r", shm_key, 0, 64)
    await one.register_system("q", shm_key, 0, 64)
    assert await one.hold([await use(one, "r"), await use(one, "q")], timeout_s=5)
    await two.unregister_system(None)
    clock.ms += 4_000
    assert sorted(await listed(two)) == ["q", "r"]
    clock.ms += 1_001
    assert await two.catch_up()  # the refresh's load removes them
    assert await listed(two) == []


async def test_a_name_whose_holders_lapsed_can_be_registered_at_once(
    store: RegionStore, clock: Clock, tmp_path: Path, shm_key: str
) -> None:
    one, two = pair(store, tmp_path)
    await one.register_system("r", shm_key, 0, 64)
    assert await one.hold([await use(one, "r")], timeout_s=5)
    await one.unregister_system("r")
    with pytest.raises(InvalidInput, match="already in manager"):
        await two.register_system("r", shm_key, 0, 32)
    clock.ms += 6_000
    await two.register_system("r", shm_key, 0, 32)
    assert await one.system_status("r") == [
        {"name": "r", "key": shm_key, "offset": 0, "byte_size": 32}
    ]


async def test_a_request_whose_region_went_since_it_was_read_is_refused(
    store: RegionStore, tmp_path: Path, shm_key: str
) -> None:
    one, two = pair(store, tmp_path)
    await one.register_system("r", shm_key, 0, 64)
    read = await use(one, "r", offset=32, size=32)
    await two.unregister_system("r")  # nobody held it: gone
    with pytest.raises(InvalidInput) as gone:
        await one.hold([read], timeout_s=30)
    assert gone.value.message.startswith("input 'x': unknown shared memory region 'r' (")
    # Registered anew, smaller: the bytes it read are not in it.
    await two.register_system("r", shm_key, 0, 48)
    with pytest.raises(InvalidInput, match="unknown shared memory region 'r'"):
        await one.hold([read], timeout_s=30)
    # Registered anew as it was: those bytes are the region's again.
    await two.unregister_system("r")
    await two.register_system("r", shm_key, 0, 64)
    assert await one.hold([read], timeout_s=30) is not None


async def test_a_request_that_names_no_region_holds_nothing(
    store: RegionStore, tmp_path: Path
) -> None:
    one, _ = pair(store, tmp_path)
    assert await one.hold([], timeout_s=30) is None


async def test_the_leases_live_in_redis_next_to_the_records(
    redis: Redis, keys: Keys, clock: Clock, tmp_path: Path, shm_key: str
) -> None:
    store = RedisRegionStore(redis, keys, HOST, ttl_s=30, clock=clock)
    one, two = pair(store, tmp_path)
    await one.register_system("r", shm_key, 0, 64)
    lease = await one.hold([await use(one, "r")], timeout_s=5)
    assert lease is not None
    users = keys.client_region_users(HOST, "anonymous/r")  # (the tenant's region 'r')
    assert await redis.zrange(users, 0, -1, withscores=True) == [
        (lease.id.encode(), float(clock.ms + 5_000))
    ]
    assert 0 < await redis.pttl(users) <= 6_000  # it goes with its last lease
    await two.unregister_system("r")
    assert await redis.hgetall(keys.client_regions_draining(HOST)) == {b"anonymous/r": b"1"}
    await one.release(lease)
    assert not await redis.exists(users, keys.client_regions_draining(HOST))
    assert await redis.hgetall(keys.client_regions(HOST, "system")) == {}


# -- the requests ----------------------------------------------------------------------


def test_a_request_uses_the_regions_its_inputs_and_outputs_name() -> None:
    into, out = ShmRef("/k", 8, 16), ShmRef("/k", 64, 16)
    parsed = InferRequest(
        "id",
        [
            InputTensor("A", "FP32", (4,), b"", into, "in"),
            InputTensor("B", "FP32", (4,), b"\0" * 16),
        ],
        [RequestedOutput("C", True, out, "out"), RequestedOutput("D", True)],
        {},
        1,
    )
    assert region_uses(parsed) == [
        RegionUse("input 'A'", "in", into),
        RegionUse("output 'C'", "out", out),
    ]


def shm_request(registry: RegionRegistry, name: str) -> InferRequest:
    ref = registry.resolve("input 'A'", name, 0, 16)
    return InferRequest("id", [InputTensor("A", "FP32", (4,), b"", ref, name)], [], {}, 1)


async def test_regions_are_given_back_however_the_request_ends(
    tmp_path: Path, shm_key: str
) -> None:
    store = MemoryRegionStore()
    one, two = pair(store, tmp_path)
    await one.register_system("r", shm_key, 0, 64)
    await one.catch_up()
    with pytest.raises(RuntimeError):
        uses = region_uses(shm_request(one, "r"))
        async with regions_held(one, uses, timeout_us=30_000_000):
            assert store.users["anonymous/r"]
            raise RuntimeError("the request failed")
    assert not store.users
    await two.unregister_system("r")
    assert await listed(one) == []


def gateway_state(registry: RegionRegistry) -> GatewayState:
    fast = in_process_gateway(
        "echo", identity_config("echo", ["FP32"], [-1], 8), EchoDispatcher(["OUT_FP32"])
    )
    state: GatewayState = fast.app.state.sluice
    state.regions = state.transfer.regions = registry
    return state


class Running:
    def __init__(self, parsed: InferRequest) -> None:
        self.parsed = parsed
        self.timeout_us = 30_000_000


async def test_a_stream_holds_its_regions_until_the_consumer_closes_it(
    tmp_path: Path, shm_key: str
) -> None:
    store = MemoryRegionStore()
    one, two = pair(store, tmp_path)
    await one.register_system("r", shm_key, 0, 64)
    await one.catch_up()

    @holding_regions_stream
    async def responses(state: GatewayState, request: Running) -> AsyncGenerator[int, None]:
        for number in range(10):
            yield number

    stream = responses(gateway_state(one), Running(shm_request(one, "r")))
    assert await anext(stream) == 0
    await two.unregister_system("r")
    assert await listed(two) == ["r"]
    await stream.aclose()
    assert await listed(two) == []


class GatedDispatcher(EchoDispatcher):
    """Answers once the test opens the gate."""

    def __init__(self, outputs: list[str]) -> None:
        super().__init__(outputs)
        self.entered = asyncio.Event()
        self.gate = asyncio.Event()

    async def submit(
        self, model: str, stream: str, message: RequestMessage, payload: bytes, timeout_s: float
    ) -> Reply:
        self.entered.set()
        await self.gate.wait()
        return await super().submit(model, stream, message, payload, timeout_s)


def gated_gateway(registry: RegionRegistry) -> tuple[httpx.AsyncClient, GatedDispatcher]:
    dispatcher = GatedDispatcher(["OUT_FP32"])
    fast = in_process_gateway("echo", identity_config("echo", ["FP32"], [-1], 8), dispatcher)
    fast.app.state.sluice.regions = fast.app.state.sluice.transfer.regions = registry
    transport = httpx.ASGITransport(app=fast)
    return httpx.AsyncClient(transport=transport, base_url="http://gateway"), dispatcher


BODY = {
    "inputs": [
        {
            "name": "IN_FP32",
            "datatype": "FP32",
            "shape": [1, 4],
            "parameters": {"shared_memory_region": "r", "shared_memory_byte_size": 16},
        }
    ]
}


async def test_a_region_unregistered_during_an_inference_serves_it_to_the_end(
    tmp_path: Path, shm_key: str
) -> None:
    """Through the REST routes, unregistered through another process meanwhile."""
    store = MemoryRegionStore()
    elsewhere, here = pair(store, tmp_path)
    values = np.arange(4, dtype=np.float32)
    (SHM_DIR / shm_key[1:]).write_bytes(values.tobytes())
    await elsewhere.register_system("r", shm_key, 0, 16)
    client, dispatcher = gated_gateway(here)
    async with client:
        inference = asyncio.create_task(client.post("/v2/models/echo/infer", json=BODY))
        await asyncio.wait_for(dispatcher.entered.wait(), 30)
        unregistered = await client.post("/v2/systemsharedmemory/region/r/unregister")
        assert unregistered.status_code == 200, unregistered.text
        status = await client.get("/v2/systemsharedmemory/status")
        assert [row["name"] for row in status.json()] == ["r"]
        assert await listed(elsewhere) == ["r"]
        dispatcher.gate.set()
        answer = await inference
        assert answer.status_code == 200, answer.text
        assert answer.json()["outputs"][0]["data"] == values.tolist()
        assert (await client.get("/v2/systemsharedmemory/status")).json() == []
        missing = await client.get("/v2/systemsharedmemory/region/r/status")
        assert missing.status_code == 404
        assert await listed(elsewhere) == []


async def test_a_cancelled_inference_gives_its_regions_back(tmp_path: Path, shm_key: str) -> None:
    store = MemoryRegionStore()
    elsewhere, here = pair(store, tmp_path)
    await elsewhere.register_system("r", shm_key, 0, 16)
    client, dispatcher = gated_gateway(here)
    async with client:
        inference = asyncio.create_task(client.post("/v2/models/echo/infer", json=BODY))
        await asyncio.wait_for(dispatcher.entered.wait(), 30)
        await elsewhere.unregister_system("r")
        assert await listed(elsewhere) == ["r"]
        inference.cancel()
        with pytest.raises(asyncio.CancelledError):
            await inference
    assert not store.users
    assert await listed(elsewhere) == []
