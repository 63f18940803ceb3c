"""A client's shared memory cannot crash Sluice, nor reach what the client could not.

- A region key that names a symbolic link (to any file, to another request's segment,
  made by this user or by another one) or a hard link is refused at registration, and
  again whenever a worker or the gateway opens the key: the object may be replaced by a
  link after registration.
- A region that shrinks while a request uses it fails that request with a 400; the
  worker and the gateway that read or write it keep running (same pids) and serving.
  Before, both mapped client objects and died of SIGBUS.
- A shared memory input may not be larger than the gateway's body limit.
- A tenant reaches its own regions alone: another tenant's is an unknown region.

Every object these tests make under /dev/shm is removed again.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from sluice.core.shm import SHM_DIR, new_segment_name, segment_prefix
from sluice.scheduler.executor.redis_server import RedisServer
from tests.support import procs
from tests.support.onnx_models import write_identity
from tests.support.stack import Stack
from tests.support.stall import probe_while, stall_limit

MIB = 1 << 20
BODY_LIMIT = 48 * MIB
ENV = {
    "SLUICE_SHM_THRESHOLD_BYTES": str(64 * 1024),
    "SLUICE_MAX_BODY_BYTES": str(BODY_LIMIT),
    "SLUICE_SHM_SWEEP_INTERVAL_S": "0.5",
}
SECRET = b"top secret bytes of a file the client cannot read!" * 4  # 200 bytes
NOBODY = 65534


def _start(redis: RedisServer, root: Path, same_host: bool) -> Stack:
    write_identity(root, "ident", ["FP32"])
    write_identity(root, "ident_bytes", ["BYTES"])
    env = {**ENV, "SLUICE_SHM_SAME_HOST": "true" if same_host else "false"}
    stack = Stack(root, redis.url, env=env)
    stack.start()
    return stack


@pytest.fixture(scope="module")
def local(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """Gateway and workers on one host: the worker reads and writes client regions."""
    stack = _start(redis_server, tmp_path_factory.mktemp("local"), same_host=True)
    yield stack
    stack.stop()
    assert _segments(stack) == []


@pytest.fixture(scope="module")
def remote(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """As across hosts: the gateway reads and writes client regions itself."""
    stack = _start(redis_server, tmp_path_factory.mktemp("remote"), same_host=False)
    yield stack
    stack.stop()
    assert _segments(stack) == []


def _segments(stack: Stack) -> list[str]:
    prefix = segment_prefix(stack.namespace)
    return [name for name in os.listdir(SHM_DIR) if name.startswith(prefix)]


@pytest.fixture
def made() -> Iterator[list[Path]]:
    """Paths the test creates (objects, links, files); all removed at the end."""
    paths: list[Path] = []
    yield paths
    for path in paths:
        path.unlink(missing_ok=True)


def new_object(made: list[Path], size: int, data: bytes = b"") -> Path:
    path = SHM_DIR / f"shmsec-{uuid.uuid4().hex}"
    made.append(path)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, size)
        if data:
            os.pwrite(fd, data, 0)
    finally:
        os.close(fd)
    return path


def secret_file(made: list[Path], tmp_path: Path) -> Path:
    """A file outside /dev/shm that only root may read."""
    path = tmp_path / f"secret-{uuid.uuid4().hex}"
    made.append(path)
    path.write_bytes(SECRET)
    path.chmod(0o600)
    return path


def key(path: Path) -> str:
    return "/" + path.name


class Client:
    """Raw HTTP against one stack, with the process identities it started with."""

    def __init__(self, stack: Stack) -> None:
        assert stack.process is not None
        self.stack = stack
        self.http = httpx.Client(base_url=stack.url, timeout=60)
        self.gateways = procs.gateway_pids(stack.process.pid)
        self.workers = procs.worker_pids(stack.process.pid)

    def register(self, name: str, path: Path | str, byte_size: int, offset: int = 0) -> Any:
        shm_key = path if isinstance(path, str) else key(path)
        body = {"key": shm_key, "offset": offset, "byte_size": byte_size}
        return self.http.post(f"/v2/systemsharedmemory/region/{name}/register", json=body)

    def status(self) -> list[str]:
        response = self.http.get("/v2/systemsharedmemory/status")
        assert response.status_code == 200, response.text
        return [row["name"] for row in response.json()]

    def infer(self, model: str, body: dict[str, Any]) -> httpx.Response:
        return self.http.post(f"/v2/models/{model}/infer", json=body)

    def assert_unharmed(self) -> None:
        """Same gateway and workers as at the start, all alive, and serving."""
        assert self.stack.process is not None and self.stack.process.poll() is None
        assert all(procs.alive(pid) for pid in self.gateways)
        assert procs.gateway_pids(self.stack.process.pid) == self.gateways
        assert procs.worker_pids(self.stack.process.pid) == self.workers
        assert all(procs.alive(pid) for pid in self.workers)
        data = [1.5, -2.0, 3.25]
        body = {"inputs": [{"name": "IN_FP32", "shape": [1, 3], "datatype": "FP32", "data": data}]}
        response = self.infer("ident", body)
        assert response.status_code == 200, response.text[:300]
        assert response.json()["outputs"][0]["data"] == data

    def close(self) -> None:
        self.http.post("/v2/systemsharedmemory/unregister")
        self.http.close()


@pytest.fixture
def on_local(local: Stack) -> Iterator[Client]:
    client = Client(local)
    yield client
    client.assert_unharmed()
    client.close()


@pytest.fixture
def on_remote(remote: Stack) -> Iterator[Client]:
    client = Client(remote)
    yield client
    client.assert_unharmed()
    client.close()


def fp32_input(region: str, count: int) -> dict[str, Any]:
    return {
        "name": "IN_FP32",
        "shape": [1, count],
        "datatype": "FP32",
        "parameters": {"shared_memory_region": region, "shared_memory_byte_size": 4 * count},
    }


def fp32_output(region: str, count: int) -> dict[str, Any]:
    return {
        "name": "OUT_FP32",
        "parameters": {"shared_memory_region": region, "shared_memory_byte_size": 4 * count},
    }


def refused(response: httpx.Response, *fragments: str) -> str:
    assert response.status_code == 400, response.text[:300]
    message = str(response.json()["error"])
    for fragment in fragments:
        assert fragment in message, message
    return message


# -- links ---------------------------------------------------------------------------------


def test_symbolic_links_are_refused_at_registration(
    on_local: Client, made: list[Path], tmp_path: Path
) -> None:
    secret = secret_file(made, tmp_path)
    outside = SHM_DIR / f"shmsec-{uuid.uuid4().hex}"
    made.append(outside)
    outside.symlink_to(secret)
    refused(on_local.register("outside", outside, len(SECRET)), f"'{key(outside)}'", "link")

    # Another request's tensor: a link to one of Sluice's own segments.
    segment = SHM_DIR / new_segment_name(segment_prefix(on_local.stack.namespace), "in")
    made.append(segment)
    segment.write_bytes(SECRET)
    segment.chmod(0o600)
    inside = SHM_DIR / f"shmsec-{uuid.uuid4().hex}"
    made.append(inside)
    inside.symlink_to(segment)
    refused(on_local.register("inside", inside, len(SECRET)), f"'{key(inside)}'", "link")

    # A hard link to someone else's object is refused too (two names, one object).
    victim = new_object(made, 4096, SECRET)
    hard = SHM_DIR / f"shmsec-{uuid.uuid4().hex}"
    made.append(hard)
    os.link(victim, hard)
    refused(on_local.register("hard", hard, 4096), f"'{key(hard)}'", "link")

    assert on_local.status() == []


def _link_as_nobody(link: Path, target: Path) -> None:
    """Make ``link`` -> ``target`` from a child process running as nobody:nogroup."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            os.symlink(target, link)
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert link.is_symlink() and link.lstat().st_uid == NOBODY


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
def test_a_link_made_by_another_user_is_refused(
    on_local: Client, made: list[Path], tmp_path: Path
) -> None:
    secret = secret_file(made, tmp_path)
    link = SHM_DIR / f"shmsec-{uuid.uuid4().hex}"
    made.append(link)
    _link_as_nobody(link, secret)
    refused(on_local.register("theirs", link, len(SECRET)), f"'{key(link)}'", "link")
    assert on_local.status() == []


@pytest.mark.parametrize("where", ["local", "remote"])
def test_an_object_replaced_by_a_link_after_registration_is_refused(
    where: str, request: pytest.FixtureRequest, made: list[Path], tmp_path: Path
) -> None:
    client: Client = request.getfixturevalue(f"on_{where}")
    count = len(SECRET) // 4
    source = new_object(made, 4 * count, bytes(4 * count))
    target = new_object(made, 4 * count)
    assert client.register("in", source, 4 * count).status_code == 200
    assert client.register("out", target, 4 * count).status_code == 200
    secret = secret_file(made, tmp_path)
    victim = secret_file(made, tmp_path)

    source.unlink()
    source.symlink_to(secret)
    body = {"inputs": [fp32_input("in", count)]}
    response = client.infer("ident", body)
    refused(response, f"'{key(source)}'", "link")
    assert SECRET not in response.content

    source.unlink()  # a regular object again, so that only the output is refused
    fd = os.open(source, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.ftruncate(fd, 4 * count)
    os.close(fd)
    target.unlink()
    target.symlink_to(victim)
    body = {"inputs": [fp32_input("in", count)], "outputs": [fp32_output("out", count)]}
    refused(client.infer("ident", body), f"'{key(target)}'", "link")
    assert victim.read_bytes() == SECRET


# -- regions that shrink -------------------------------------------------------------------


@contextlib.contextmanager
def flipping(path: Path, size: int) -> Iterator[None]:
    """Truncate the object to nothing and grow it back, again and again, meanwhile."""
    stop = threading.Event()

    def run() -> None:
        fd = os.open(path, os.O_RDWR)
        try:
            while not stop.is_set():  # mostly whole: some requests get through
                os.ftruncate(fd, 0)
                stop.wait(0.001)
                os.ftruncate(fd, size)
                stop.wait(0.004)
        finally:
            os.ftruncate(fd, size)
            os.close(fd)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(10)


def hammer(call: Callable[[], httpx.Response], region: str, seconds: float = 2.0) -> list[int]:
    """Send requests for ``seconds``; each is a 200 or a 400 that names the region."""
    statuses: list[int] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline or len(statuses) < 5:
        response = call()
        assert response.status_code in (200, 400), response.text[:300]
        if response.status_code == 400:
            assert f"'{region}'" in response.json()["error"], response.text
        statuses.append(response.status_code)
        if len(statuses) >= 200:
            break
    return statuses


@pytest.mark.parametrize("side", ["input", "output"])
def test_a_region_shrinking_under_the_worker_fails_only_that_request(
    side: str, on_local: Client, made: list[Path]
) -> None:
    count = 8 * MIB  # 32 MiB of FP32
    size = 4 * count
    source, target = new_object(made, size), new_object(made, size)
    assert on_local.register("in", source, size).status_code == 200
    assert on_local.register("out", target, size).status_code == 200
    body = {"inputs": [fp32_input("in", count)], "outputs": [fp32_output("out", count)]}
    flipped = source if side == "input" else target
    with flipping(flipped, size):
        statuses = hammer(lambda: on_local.infer("ident", body), key(flipped))
    assert 400 in statuses or 200 in statuses


@pytest.mark.parametrize("side", ["input", "output"])
def test_a_region_shrinking_under_the_gateway_fails_only_that_request(
    side: str, on_remote: Client, made: list[Path]
) -> None:
    count = 2 * MIB  # 8 MiB of FP32, through Redis
    size = 4 * count
    source, target = new_object(made, size), new_object(made, size)
    assert on_remote.register("in", source, size).status_code == 200
    assert on_remote.register("out", target, size).status_code == 200
    body = {"inputs": [fp32_input("in", count)], "outputs": [fp32_output("out", count)]}
    flipped = source if side == "input" else target
    with flipping(flipped, size):
        hammer(lambda: on_remote.infer("ident", body), key(flipped))


def test_a_bytes_region_shrinking_while_the_gateway_counts_its_elements(
    on_local: Client, made: list[Path]
) -> None:
    size = 2 * MIB  # zeros: 512 Ki empty BYTES elements, whatever the truncation left
    source = new_object(made, size)
    assert on_local.register("strings", source, size).status_code == 200
    tensor = {
        "name": "IN_BYTES",
        "shape": [1, size // 4],
        "datatype": "BYTES",
        "parameters": {"shared_memory_region": "strings", "shared_memory_byte_size": size},
    }
    body = {"inputs": [tensor], "outputs": [{"name": "OUT_BYTES", "parameters": {}}]}
    body["outputs"][0]["parameters"]["binary_data"] = True
    with flipping(source, size):
        hammer(lambda: on_local.infer("ident_bytes", body), key(source), seconds=3.0)


# -- limits --------------------------------------------------------------------------------


def test_shared_memory_inputs_are_limited_and_huge_sizes_are_400s(
    on_local: Client, made: list[Path]
) -> None:
    count = BODY_LIMIT // 4 + 1024
    source = new_object(made, 4 * count)  # sparse: nothing is written
    assert on_local.register("big", source, 4 * count).status_code == 200
    refused(
        on_local.infer("ident", {"inputs": [fp32_input("big", count)]}),
        "input 'IN_FP32'",
        "'big'",
        f"{BODY_LIMIT} bytes",
    )
    # An output may fill its whole region: no limit but the region's size.
    small = np.arange(4, dtype=np.float32)
    inline = {"name": "IN_FP32", "shape": [1, 4], "datatype": "FP32", "data": small.tolist()}
    body = {"inputs": [inline], "outputs": [fp32_output("big", count)]}
    response = on_local.infer("ident", body)
    assert response.status_code == 200, response.text[:300]
    np.testing.assert_array_equal(np.fromfile(source, np.float32, 4), small)

    huge = (1 << 64) - 1  # the largest integer a JSON body may carry here
    refused(on_local.register("q", source, huge), "'q'")
    refused(on_local.register("q", source, 16, offset=huge), "'q'")
    tensor = {
        "name": "IN_BYTES",
        "shape": [1, 1],
        "datatype": "BYTES",
        "parameters": {"shared_memory_region": "big", "shared_memory_byte_size": huge},
    }
    refused(on_local.infer("ident_bytes", {"inputs": [tensor]}), "input 'IN_BYTES'")
    tensor["parameters"] = {
        "shared_memory_region": "big",
        "shared_memory_byte_size": 8,
        "shared_memory_offset": huge,
    }
    refused(on_local.infer("ident_bytes", {"inputs": [tensor]}), "input 'IN_BYTES'")


# -- the event loop ------------------------------------------------------------------------


def test_counting_a_huge_bytes_region_does_not_stall_other_clients(
    on_local: Client, made: list[Path]
) -> None:
    """12 Mi empty BYTES elements in a region are counted off the gateway's event loop
    (before: /v2/health/live waited seconds for it)."""
    size = BODY_LIMIT  # zeros: size // 4 empty elements
    source = new_object(made, size)
    assert on_local.register("many", source, size).status_code == 200
    tensor = {
        "name": "IN_BYTES",
        "shape": [1, size // 4 + 1],  # one more than there are: a 400 once all are counted
        "datatype": "BYTES",
        "parameters": {"shared_memory_region": "many", "shared_memory_byte_size": size},
    }
    limit = stall_limit(on_local.stack.url)
    probed = probe_while(
        on_local.stack.url, lambda: on_local.infer("ident_bytes", {"inputs": [tensor]})
    )
    refused(probed.result, "input 'IN_BYTES'")
    assert probed.probes >= 5, "the count ended too soon to measure anything"
    allowed = probed.stall_allowed_s(limit)
    assert probed.slowest_s < allowed, (
        f"a health probe took {probed.slowest_s:.2f} s while a region was counted "
        f"({probed.took_s:.2f} s; allowed {allowed:.2f} s)"
    )
    on_local.http.post("/v2/systemsharedmemory/region/many/unregister")


# -- tenants ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def keyed(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """With API keys: team-a and ops hold admin keys (they may register regions), team-b
    an inference key."""
    root = tmp_path_factory.mktemp("keyed")
    write_identity(root, "ident", ["FP32"])
    keys = {"SLUICE_API_KEYS": "team-b:key-b", "SLUICE_ADMIN_KEYS": "team-a:key-a,ops:key-ops"}
    stack = Stack(root, redis_server.url, env={**ENV, "SLUICE_SHM_SAME_HOST": "true", **keys})
    stack.start()
    yield stack
    stack.stop()


def test_a_tenant_reaches_none_of_another_tenants_regions(keyed: Stack, made: list[Path]) -> None:
    """Before, regions were one name space for the host: team-b's inference key read
    team-a's region ('in') through a model and wrote its own results into it, and ops
    listed and unregistered it. Now each tenant sees its own regions alone; another's name
    is an unknown region, and free to take."""
    secret = np.arange(4, dtype=np.float32)
    source = new_object(made, 32, secret.tobytes())
    other = new_object(made, 16)
    as_a, as_b, as_ops = ({"Authorization": f"Bearer key-{who}"} for who in ("a", "b", "ops"))
    with httpx.Client(base_url=keyed.url, timeout=60) as http:
        register = "/v2/systemsharedmemory/region/in/register"
        body = {"key": key(source), "offset": 0, "byte_size": 32}
        assert http.post(register, json=body, headers=as_a).status_code == 200
        reading = {"inputs": [fp32_input("in", 4)]}
        inline = {"name": "IN_FP32", "shape": [1, 4], "datatype": "FP32", "data": [9] * 4}
        writing = {"inputs": [inline], "outputs": [fp32_output("in", 4)]}
        for request in (reading, writing):
            answer = http.post("/v2/models/ident/infer", json=request, headers=as_b)
            refused(answer, "unknown shared memory region 'in'")
        assert source.read_bytes() == secret.tobytes() + bytes(16)
        answer = http.post("/v2/models/ident/infer", json=reading, headers=as_a)
        assert answer.status_code == 200, answer.text
        assert answer.json()["outputs"][0]["data"] == secret.tolist()

        status = "/v2/systemsharedmemory/status"
        assert http.get(status, headers=as_ops).json() == []
        answer = http.get("/v2/systemsharedmemory/region/in/status", headers=as_ops)
        assert answer.status_code == 404, answer.text
        mine = {"key": key(other), "offset": 0, "byte_size": 16}
        assert http.post(register, json=mine, headers=as_ops).status_code == 200
        assert http.post("/v2/systemsharedmemory/unregister", headers=as_ops).status_code == 200
        assert [row["name"] for row in http.get(status, headers=as_a).json()] == ["in"]

    with grpcclient.InferenceServerClient(keyed.grpc_address) as rpc:
        grpc_a = {"authorization": "Bearer key-a"}
        grpc_ops = {"authorization": "Bearer key-ops"}
        assert set(rpc.get_system_shared_memory_status(headers=grpc_a).regions) == {"in"}
        assert rpc.get_system_shared_memory_status(headers=grpc_ops).regions == {}
        rpc.unregister_system_shared_memory("in", headers=grpc_ops)  # (not its own: no-op)
        rpc.unregister_system_shared_memory(headers=grpc_ops)
        assert set(rpc.get_system_shared_memory_status(headers=grpc_a).regions) == {"in"}
        tensor = grpcclient.InferInput("IN_FP32", [1, 4], "FP32")
        tensor.set_shared_memory("in", 16)
        with pytest.raises(InferenceServerException, match="unknown shared memory region 'in'"):
            rpc.infer("ident", [tensor], headers={"authorization": "Bearer key-b"})
        result = rpc.infer("ident", [tensor], headers=grpc_a)
        np.testing.assert_array_equal(result.as_numpy("OUT_FP32"), secret.reshape(1, 4))
        rpc.unregister_system_shared_memory(headers=grpc_a)
        assert rpc.get_system_shared_memory_status(headers=grpc_a).regions == {}
