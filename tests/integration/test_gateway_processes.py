"""Several gateway processes behind one port (issue 28): client shared memory regions, the
logging extension and gRPC behave as one server, whichever process a connection reaches.

Each test opens many new connections, which SO_REUSEPORT spreads over the processes, and
keeps them open: which process holds each one is read from the processes' sockets, so the
test knows that more than one process answered.
"""

from __future__ import annotations

import http.client
import json
import uuid
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any, cast

import httpx
import numpy as np
import psutil
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.utils.shared_memory as shm
from redis import Redis
from tritonclient.utils import InferenceServerException

from sluice.core.keys import Keys
from sluice.scheduler.executor.redis_server import RedisServer
from tests.support import procs
from tests.support.onnx_models import write_identity
from tests.support.stack import Stack

CONNECTIONS = 24
"""New connections per check: all on one of two processes has odds of 2**-23."""


@pytest.fixture(scope="module")
def two(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("processes")
    write_identity(root, "ident", ["FP32"])
    stack = Stack(root, redis_server.url, args=["--gateway-processes", "2"])
    stack.start()
    assert procs.wait_until(lambda: len(gateway_pids(stack)) == 2, 30)
    # Both have reported in (their gRPC servers are up, their catalogs known).
    assert procs.wait_until(lambda: "sluice_gateway_processes 2.0" in metrics(stack), 30)
    yield stack
    stack.stop()


def metrics(stack: Stack) -> str:
    try:
        return httpx.get(f"{stack.url}/metrics", timeout=10).text
    except httpx.HTTPError:
        return ""


def gateway_pids(stack: Stack) -> list[int]:
    assert stack.process is not None
    return [
        pid for pid in procs.children(stack.process.pid) if "sluice.gateway" in procs.cmdline(pid)
    ]


def holders(stack: Stack, port: int) -> dict[int, int]:
    """Client port -> the gateway process holding that connection to ``port``."""
    found: dict[int, int] = {}
    for pid in gateway_pids(stack):
        for conn in psutil.Process(pid).net_connections(kind="tcp"):
            if conn.laddr and conn.raddr and conn.laddr.port == port:
                found[conn.raddr.port] = pid
    return found


@pytest.fixture
def region() -> Iterator[tuple[Any, str]]:
    key = f"/procs-{uuid.uuid4().hex[:10]}"
    handle = shm.create_shared_memory_region("procs", key, 4096)
    yield handle, key
    shm.destroy_shared_memory_region(handle)


def infer_body(region: str, offset: int, values: int) -> bytes:
    parameters = {
        "shared_memory_region": region,
        "shared_memory_offset": offset,
        "shared_memory_byte_size": values * 4,
    }
    tensor = {"name": "IN_FP32", "datatype": "FP32", "shape": [1, values]}
    return json.dumps({"inputs": [{**tensor, "parameters": parameters}]}).encode()


def new_connections(
    two: Stack, stack: ExitStack, least: int = CONNECTIONS, most: int = 400
) -> Iterator[http.client.HTTPConnection]:
    """New HTTP connections, each used by the caller before the next is made, kept open:
    at least ``least`` and until both gateway processes hold some (they share the
    listening socket; whichever accepts first takes the connection)."""
    pids: set[int] = set()
    for count in range(most):
        if count >= least and len(pids) == 2:
            return
        conn = http.client.HTTPConnection("127.0.0.1", two.port, timeout=30)
        stack.callback(conn.close)
        yield conn
        pids.add(holders(two, two.port)[conn.sock.getsockname()[1]])
    raise AssertionError(f"{most} connections all reached one gateway process")


def post(conn: http.client.HTTPConnection, path: str, body: bytes) -> tuple[int, Any]:
    conn.request("POST", path, body, {"Content-Type": "application/json"})
    response = conn.getresponse()
    data = response.read()
    return response.status, json.loads(data) if data else None


def get(conn: http.client.HTTPConnection, path: str) -> tuple[int, Any]:
    conn.request("GET", path)
    response = conn.getresponse()
    return response.status, json.loads(response.read())


def test_a_region_registered_through_one_process_serves_them_all(
    two: Stack, region: tuple[Any, str]
) -> None:
    handle, key = region
    data = np.arange(16, dtype=np.float32)
    shm.set_shared_memory_region(handle, [data, data * 2])
    body = json.dumps({"key": key, "offset": 0, "byte_size": 128}).encode()
    with httpx.Client(base_url=two.url, timeout=30) as first:
        registered = first.post("/v2/systemsharedmemory/region/r/register", content=body)
        assert registered.status_code == 200, registered.text
    with ExitStack() as stack:
        conns = []
        for conn in new_connections(two, stack):
            conns.append(conn)
            status, answer = post(conn, "/v2/models/ident/infer", infer_body("r", 0, 16))
            assert status == 200, answer
            assert answer["outputs"][0]["data"] == data.tolist()
            # Status from any process lists the region as registered.
            status, regions = get(conn, "/v2/systemsharedmemory/status")
            assert status == 200
            assert regions == [{"name": "r", "key": key, "offset": 0, "byte_size": 128}]

        # Registered anew elsewhere with other bounds: every process uses the new ones.
        with httpx.Client(base_url=two.url, timeout=30) as other:
            assert other.post("/v2/systemsharedmemory/region/r/unregister").status_code == 200
            moved = json.dumps({"key": key, "offset": 64, "byte_size": 64}).encode()
            assert other.post("/v2/systemsharedmemory/region/r/register", content=moved).is_success
        for conn in conns:
            status, answer = post(conn, "/v2/models/ident/infer", infer_body("r", 0, 16))
            assert status == 200, answer
            assert answer["outputs"][0]["data"] == (data * 2).tolist()

        # Unregistered through one connection: refused through every other at once.
        status, _ = post(conns[0], "/v2/systemsharedmemory/unregister", b"")
        assert status == 200
        for conn in conns:
            status, answer = post(conn, "/v2/models/ident/infer", infer_body("r", 0, 16))
            assert status == 400
            assert "unknown shared memory region 'r'" in answer["error"]
            status, error = get(conn, "/v2/systemsharedmemory/region/r/status")
            assert status == 404
            assert error == {"error": "Unable to find system shared memory region: 'r'"}


def test_regions_over_grpc_across_processes(two: Stack, region: tuple[Any, str]) -> None:
    handle, key = region
    data = np.arange(32, dtype=np.float32).reshape(2, 16)
    shm.set_shared_memory_region(handle, [data])
    # A channel of its own per client (gRPC would otherwise share one connection).
    options = [("grpc.use_local_subchannel_pool", 1)]
    with ExitStack() as stack:
        first = stack.enter_context(
            grpcclient.InferenceServerClient(two.grpc_address, channel_args=options)
        )
        first.register_system_shared_memory("g", key, data.nbytes)
        clients = [
            stack.enter_context(
                grpcclient.InferenceServerClient(two.grpc_address, channel_args=options)
            )
            for _ in range(CONNECTIONS)
        ]
        for client in clients:
            tensor = grpcclient.InferInput("IN_FP32", [2, 16], "FP32")
            tensor.set_shared_memory("g", data.nbytes)
            answer = client.infer("ident", [tensor]).as_numpy("OUT_FP32")
            np.testing.assert_array_equal(answer, data)
            regions = client.get_system_shared_memory_status().regions
            assert set(regions) == {"g"} and regions["g"].key == key
        answered = set(holders(two, two.grpc_port).values())
        assert len(answered) == 2, "the channels reached both gateway processes"

        clients[-1].unregister_system_shared_memory("g")
        for client in clients:
            tensor = grpcclient.InferInput("IN_FP32", [2, 16], "FP32")
            tensor.set_shared_memory("g", data.nbytes)
            with pytest.raises(InferenceServerException) as refused:
                client.infer("ident", [tensor])
            assert refused.value.status() == "StatusCode.INVALID_ARGUMENT"
            assert "unknown shared memory region 'g'" in refused.value.message()
            assert client.get_system_shared_memory_status().regions == {}


def test_a_logging_change_reaches_every_process(two: Stack) -> None:
    with httpx.Client(base_url=two.url, timeout=30) as client:
        changed = client.post("/v2/logging", json={"log_verbose_level": 1})
        assert changed.json()["log_verbose_level"] == 1
    try:
        with ExitStack() as stack:
            ids = []
            for conn in new_connections(two, stack):
                status, settings = get(conn, "/v2/logging")
                assert (status, settings["log_verbose_level"]) == (200, 1)
                # A refused request is logged at debug level: only where verbose is on.
                request_id = f"procs-{uuid.uuid4().hex}"
                conn.request(
                    "POST", "/v2/models/nothing/infer", b"{}", {"X-Request-ID": request_id}
                )
                response = conn.getresponse()
                response.read()
                assert response.status == 404
                ids.append(request_id)
        for request_id in ids:
            assert procs.wait_until(
                lambda rid=request_id: any(rid in line for line in two.stderr_lines), 10
            ), request_id
    finally:
        with httpx.Client(base_url=two.url, timeout=30) as client:
            client.post("/v2/logging", json={"log_verbose_level": 0})


@pytest.fixture(scope="module")
def explicit_two(
    redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("explicit_processes")
    write_identity(root, "ident", ["FP32"])
    write_identity(root, "later", ["FP32"])
    stack = Stack(
        root,
        redis_server.url,
        args=[
            *("--gateway-processes", "2", "--model-control-mode", "explicit"),
            *("--load-model", "ident"),
        ],
    )
    stack.start()
    assert procs.wait_until(lambda: len(gateway_pids(stack)) == 2, 30)
    yield stack
    stack.stop()


def ready_status(conn: http.client.HTTPConnection, model: str) -> int:
    conn.request("GET", f"/v2/models/{model}/ready")
    response = conn.getresponse()
    response.read()
    return response.status


def test_a_load_through_one_process_is_served_by_all_at_once(explicit_two: Stack) -> None:
    """Triton's users load a model, then ask whether it is ready and infer, each call on
    whichever pooled connection is free: every gateway process knows of a load or an unload
    before the call that carried it out is answered."""
    body = json.dumps(
        {"inputs": [{"name": "IN_FP32", "datatype": "FP32", "shape": [1, 2], "data": [1, 2]}]}
    ).encode()
    with ExitStack() as stack:
        conns = []
        for conn in new_connections(explicit_two, stack):
            assert ready_status(conn, "later") != 200
            conns.append(conn)
        for _ in range(3):
            status, answer = post(conns[0], "/v2/repository/models/later/load", b"")
            assert status == 200, answer
            for conn in conns:
                assert ready_status(conn, "later") == 200
                status, answer = post(conn, "/v2/models/later/infer", body)
                assert status == 200, answer
            status, answer = post(conns[-1], "/v2/repository/models/later/unload", b"")
            assert status == 200, answer
            for conn in conns:
                status, _ = post(conn, "/v2/models/later/infer", body)
                assert status != 200
                assert ready_status(conn, "later") != 200


def test_a_stopped_gateway_leaves_the_live_processes_at_once(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    """The live processes divide the tenants' rates: one that stopped (restarted, or that
    could not take its port) must not count until its report expires."""
    write_identity(tmp_path, "ident", ["FP32"])
    stack = Stack(tmp_path, redis_server.url)
    keys = Keys(stack.namespace)
    with Redis.from_url(redis_server.url) as redis:
        stack.start()
        try:
            assert procs.wait_until(lambda: redis.zcard(keys.gateways) == 1, 30)
            [member] = cast(list[bytes], redis.zrange(keys.gateways, 0, -1))
        finally:
            stack.stop()
        assert redis.zcard(keys.gateways) == 0
        assert not redis.exists(keys.gateway_report(member.decode()))
