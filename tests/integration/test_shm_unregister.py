"""Unregistering client shared memory regions while inference requests use them, as Triton
does, with tritonclient over HTTP and gRPC on one real stack (two gateway processes, so the
request, the unregister and the status calls may each reach a different one): the unregister
answers at once, the regions stay listed (and usable by new requests) while a request uses
them, every request succeeds, and once the last one ended the regions are gone without
another call.

A gate model (tests.support.gate_model) takes ``IN`` from a region and writes ``OUT`` into
another; it holds each request until the test lets it go, so a request stays in flight for
as long as the checks take, however busy the machine. A request is known to be in flight
once its lease on the region is in Redis.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gevent
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from redis import Redis
from tritonclient.utils import InferenceServerException

from sluice.core.hosts import host_id
from sluice.core.keys import Keys
from sluice.core.tenants import ANONYMOUS
from sluice.scheduler.executor.redis_server import RedisServer
from tests.support import procs
from tests.support.gate_model import BLOCKER_ITERS, open_gate, write_gate
from tests.support.stack import Stack

FIRST, SECOND = "slow_first", "slow_second"
"""Two models with a worker each: a request to one never waits for the other's."""
DATA = np.array([[1.5, -2.0, 3.25, 8.0]], dtype=np.float32)
BYTES = DATA.nbytes


@pytest.fixture(scope="module")
def gate(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the test opens the models' gates."""
    return tmp_path_factory.mktemp("gates")


@pytest.fixture(scope="module")
def stack(
    redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory, gate: Path
) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("unregister")
    write_gate(root, FIRST)
    write_gate(root, SECOND)
    stack = Stack(
        root,
        redis_server.url,
        env={"SLUICE_SHM_SAME_HOST": "true", "SLUICE_TEST_GATE": str(gate)},
        args=["--gateway-processes", "2"],
    )
    stack.start()
    yield stack
    stack.stop()


@pytest.fixture
def gates(gate: Path) -> Iterator[Path]:
    """The gates, closed for the test (and opened after it, whatever happened)."""
    for name in (FIRST, SECOND):
        (gate / name).unlink(missing_ok=True)
    yield gate
    for name in (FIRST, SECOND):
        open_gate(gate, name)


@pytest.fixture
def redis(stack: Stack) -> Iterator[Redis]:
    assert stack.redis_url is not None
    client = Redis.from_url(stack.redis_url)
    yield client
    client.close()


@pytest.fixture
def objects() -> Iterator[dict[str, Any]]:
    """The client's shm objects: ``in`` holds DATA, ``out`` takes the output."""
    handles = {
        name: shm.create_shared_memory_region(name, f"/unreg-{uuid.uuid4().hex[:10]}", BYTES)
        for name in ("in", "out")
    }
    shm.set_shared_memory_region(handles["in"], [DATA])
    yield handles
    for handle in handles.values():
        shm.destroy_shared_memory_region(handle)


def key_of(handle: Any) -> str:
    return str(handle._shm_key)


def in_flight(redis: Redis, stack: Stack, region: str) -> int:
    """Requests holding a lease on the (anonymous tenant's) region (the gateways' host is
    this one)."""
    host = host_id(stack.env.get("SLUICE_HOST_ID", os.environ.get("SLUICE_HOST_ID", "")))
    users = Keys(stack.namespace).client_region_users(host, f"{ANONYMOUS}/{region}")
    return int(redis.zcard(users))


def written(handle: Any) -> np.ndarray:
    return np.array(shm.get_contents_as_numpy(handle, np.float32, [1, 4]))


# -- HTTP ------------------------------------------------------------------------------


def http_request(iters: int) -> dict[str, list[Any]]:
    tensor = httpclient.InferInput("IN", [1, 4], "FP32")
    tensor.set_shared_memory("in", BYTES)
    rounds = httpclient.InferInput("ITERS", [1, 1], "INT64")
    rounds.set_data_from_numpy(np.array([[iters]], dtype=np.int64))
    output = httpclient.InferRequestedOutput("OUT", binary_data=True)
    output.set_shared_memory("out", BYTES)
    return {"inputs": [tensor, rounds], "outputs": [output]}


def http_names(client: httpclient.InferenceServerClient) -> list[str]:
    return sorted(row["name"] for row in client.get_system_shared_memory_status())


def sent_until(check: Any, timeout_s: float) -> bool:
    """Whether ``check`` holds within ``timeout_s``, waiting in gevent's loop: tritonclient's
    HTTP ``async_infer`` sends its request from a greenlet, which gets only 10 ms before the
    call returns and runs again only while the caller yields to gevent (a busy machine may
    not have connected and sent the request by then: a plain sleep would never send it)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        gevent.sleep(0.05)
    return bool(check())


def test_regions_unregistered_during_inferences_over_http_go_after_the_last(
    stack: Stack, gates: Path, redis: Redis, objects: dict[str, Any]
) -> None:
    with (
        httpclient.InferenceServerClient(stack.address, concurrency=2) as client,
        httpclient.InferenceServerClient(stack.address) as other,
    ):
        client.register_system_shared_memory("in", key_of(objects["in"]), BYTES)
        client.register_system_shared_memory("out", key_of(objects["out"]), BYTES)
        first = client.async_infer(FIRST, **http_request(BLOCKER_ITERS))
        assert sent_until(lambda: in_flight(redis, stack, "in") == 1, 30)

        other.unregister_system_shared_memory()  # (every region) answers at once
        assert http_names(other) == ["in", "out"]
        assert other.get_system_shared_memory_status("in") == [
            {"name": "in", "key": key_of(objects["in"]), "offset": 0, "byte_size": BYTES}
        ]
        # Its name is taken until it goes.
        with pytest.raises(InferenceServerException) as taken:
            other.register_system_shared_memory("in", key_of(objects["in"]), BYTES)
        assert "shared memory region 'in' already in manager" in str(taken.value.message())
        # A new request may still use it: now two hold it.
        second = client.async_infer(SECOND, **http_request(BLOCKER_ITERS))
        held = sent_until(lambda: in_flight(redis, stack, "in") == 2, 30)
        assert held, f"{in_flight(redis, stack, 'in')} request(s) hold the region, not 2"

        open_gate(gates, FIRST)
        result = first.get_result()
        assert result.get_output("OUT")["parameters"]["shared_memory_region"] == "out"
        np.testing.assert_array_equal(written(objects["out"]), DATA)
        assert in_flight(redis, stack, "in") == 1
        assert http_names(other) == ["in", "out"]  # the second still uses them

        open_gate(gates, SECOND)
        second.get_result()
        assert in_flight(redis, stack, "in") == 0
        assert http_names(other) == []
        for name in ("in", "out"):
            with pytest.raises(InferenceServerException) as gone:
                other.get_system_shared_memory_status(name)
            assert f"Unable to find system shared memory region: '{name}'" in str(
                gone.value.message()
            )
        # The name is free again.
        other.register_system_shared_memory("in", key_of(objects["in"]), BYTES)
        other.unregister_system_shared_memory("in")
        assert http_names(client) == []


# -- gRPC ------------------------------------------------------------------------------


def grpc_names(client: grpcclient.InferenceServerClient) -> list[str]:
    status = client.get_system_shared_memory_status(as_json=True)
    return sorted(status.get("regions", {}))


def test_a_region_unregistered_during_an_inference_over_grpc_goes_after_it(
    stack: Stack, gates: Path, redis: Redis, objects: dict[str, Any]
) -> None:
    client = grpcclient.InferenceServerClient(stack.grpc_address)
    other = grpcclient.InferenceServerClient(stack.grpc_address)
    try:
        client.register_system_shared_memory("in", key_of(objects["in"]), BYTES)
        client.register_system_shared_memory("out", key_of(objects["out"]), BYTES)
        tensor = grpcclient.InferInput("IN", [1, 4], "FP32")
        tensor.set_shared_memory("in", BYTES)
        iters = grpcclient.InferInput("ITERS", [1, 1], "INT64")
        iters.set_data_from_numpy(np.array([[BLOCKER_ITERS]], dtype=np.int64))
        output = grpcclient.InferRequestedOutput("OUT")
        output.set_shared_memory("out", BYTES)
        answers: list[Any] = []
        done = threading.Event()

        def answered(result: Any, error: Any) -> None:
            answers.append(error if error is not None else result)
            done.set()

        client.async_infer(FIRST, [tensor, iters], answered, outputs=[output])
        assert procs.wait_until(lambda: in_flight(redis, stack, "in") == 1, 30)

        other.unregister_system_shared_memory("in")
        other.unregister_system_shared_memory("out")
        assert grpc_names(other) == ["in", "out"]
        open_gate(gates, FIRST)
        assert done.wait(120)
        (answer,) = answers
        assert not isinstance(answer, InferenceServerException), answer
        np.testing.assert_array_equal(written(objects["out"]), DATA)
        assert grpc_names(other) == []
        with pytest.raises(InferenceServerException) as gone:
            other.get_system_shared_memory_status("in")
        assert "Unable to find system shared memory region: 'in'" in str(gone.value.message())
    finally:
        client.unregister_system_shared_memory()
        client.close()
        other.close()
