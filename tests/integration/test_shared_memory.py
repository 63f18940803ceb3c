"""Triton's shared memory extensions with tritonclient's own utilities, on a real stack.

Issue 6: tensors in client regions reach the worker by reference and outputs are
written straight into regions; bad references are clear 400s that leave the worker
serving; large tensors sent over HTTP cross to the worker through a segment, not Redis;
no segment is left in /dev/shm afterwards.
"""

from __future__ import annotations

import base64
import os
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import msgpack
import numpy as np
import pytest
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from redis import Redis
from tritonclient.utils import InferenceServerException, serialize_byte_tensor

from sluice.core.keys import Keys
from sluice.core.shm import SHM_DIR, segment_prefix
from sluice.scheduler.executor.redis_server import RedisServer
from tests.support import procs
from tests.support.gateway_refresh import wait_for_refresh
from tests.support.onnx_models import write_identity
from tests.support.stack import Stack

SAME_HOST = {
    "SLUICE_SHM_SAME_HOST": "true",
    "SLUICE_SHM_THRESHOLD_BYTES": str(64 * 1024),
    "SLUICE_SHM_SWEEP_INTERVAL_S": "0.5",
}
RNG = np.random.default_rng(6)


def build_repository(root: Path) -> Path:
    write_identity(root, "ident", ["FP32"])
    write_identity(root, "ident_bytes", ["BYTES"])
    return root


@pytest.fixture(scope="module")
def shm_stack(
    redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    stack = Stack(build_repository(tmp_path_factory.mktemp("shm")), redis_server.url, env=SAME_HOST)
    stack.start()
    yield stack
    stack.stop()
    assert segments(stack) == []


@pytest.fixture
def client(shm_stack: Stack) -> Iterator[httpclient.InferenceServerClient]:
    with httpclient.InferenceServerClient(shm_stack.address) as client:
        yield client
        client.unregister_system_shared_memory()


Region = Callable[[str, int], Any]


@pytest.fixture
def region() -> Iterator[Region]:
    """Factory: a client shm object (tritonclient), destroyed at the end."""
    handles: list[Any] = []

    def create(name: str, byte_size: int) -> Any:
        handle = shm.create_shared_memory_region(name, f"/shmtest-{uuid.uuid4().hex}", byte_size)
        handles.append(handle)
        return handle

    yield create
    for handle in handles:
        shm.destroy_shared_memory_region(handle)


def key_of(handle: Any) -> str:
    return str(handle._shm_key)


def segments(stack: Stack) -> list[str]:
    prefix = segment_prefix(stack.namespace)
    return sorted(name for name in os.listdir(SHM_DIR) if name.startswith(prefix))


def shm_input(name: str, array: np.ndarray, region: str, offset: int = 0) -> httpclient.InferInput:
    tensor = httpclient.InferInput(name, list(array.shape), "FP32")
    tensor.set_shared_memory(region, array.nbytes, offset)
    return tensor


def shm_output(name: str, region: str, byte_size: int, offset: int = 0) -> Any:
    output = httpclient.InferRequestedOutput(name, binary_data=False)
    output.set_shared_memory(region, byte_size, offset)
    return output


def assert_serving(client: httpclient.InferenceServerClient) -> None:
    data = RNG.standard_normal((2, 5)).astype(np.float32)
    tensor = httpclient.InferInput("IN_FP32", [2, 5], "FP32")
    tensor.set_data_from_numpy(data)
    np.testing.assert_array_equal(client.infer("ident", [tensor]).as_numpy("OUT_FP32"), data)


def rejected(call: Callable[[], Any], status: str, *fragments: str) -> str:
    with pytest.raises(InferenceServerException) as info:
        call()
    message = str(info.value.message())
    assert info.value.status() == status, message
    for fragment in fragments:
        assert fragment in message, message
    return message


# -- the happy path --------------------------------------------------------------------


def test_inputs_and_outputs_in_regions_with_tritonclient(
    client: httpclient.InferenceServerClient, region: Region, shm_stack: Stack
) -> None:
    assert {"system_shared_memory", "cuda_shared_memory"} <= set(
        client.get_server_metadata()["extensions"]
    )
    data = RNG.standard_normal((3, 1000)).astype(np.float32)
    size = data.nbytes
    # One object holds the input at offset 0; the region of the output starts after it.
    handle = region("io", 2 * size + 64)
    shm.set_shared_memory_region(handle, [data])
    client.register_system_shared_memory("inputs", key_of(handle), size)
    client.register_system_shared_memory("outputs", key_of(handle), size + 64, offset=size)

    status = {row["name"]: row for row in client.get_system_shared_memory_status()}
    assert status["inputs"] == {
        "name": "inputs",
        "key": key_of(handle),
        "offset": 0,
        "byte_size": size,
    }
    assert status["outputs"]["offset"] == size
    assert client.get_system_shared_memory_status("outputs") == [status["outputs"]]

    for _ in range(3):  # the worker keeps the object mapped between requests
        result = client.infer(
            "ident",
            [shm_input("IN_FP32", data, "inputs")],
            outputs=[shm_output("OUT_FP32", "outputs", size, offset=32)],
        )
        output = result.get_output("OUT_FP32")
        assert output == {
            "name": "OUT_FP32",
            "datatype": "FP32",
            "shape": [3, 1000],
            "parameters": {"shared_memory_region": "outputs", "shared_memory_byte_size": size},
        }
        got = shm.get_contents_as_numpy(handle, np.float32, output["shape"], offset=size + 32)
        np.testing.assert_array_equal(got, data)
        del got  # a view into the object: release it before the object is destroyed
        data = data + 1
        shm.set_shared_memory_region(handle, [data])

    client.unregister_system_shared_memory("inputs")
    assert [row["name"] for row in client.get_system_shared_memory_status()] == ["outputs"]
    client.unregister_system_shared_memory()
    assert client.get_system_shared_memory_status() == []
    rejected(lambda: client.get_system_shared_memory_status("inputs"), "404", "'inputs'")
    assert segments(shm_stack) == []


def test_bytes_input_from_a_region_and_output_over_http(
    client: httpclient.InferenceServerClient, region: Region
) -> None:
    values = np.array([b"alpha", b"", b"with\x00nul", "é".encode()], dtype=np.object_)
    serialized = serialize_byte_tensor(values)
    size = len(serialized.item())
    handle = region("bytes", size + 16)
    shm.set_shared_memory_region(handle, [serialized])
    client.register_system_shared_memory("strings", key_of(handle), size + 16)

    tensor = httpclient.InferInput("IN_BYTES", [1, 4], "BYTES")
    tensor.set_shared_memory("strings", size)
    result = client.infer("ident_bytes", [tensor])
    assert result.as_numpy("OUT_BYTES").reshape(-1).tolist() == values.tolist()

    tensor.set_shared_memory("strings", size - 1)  # cuts the last element
    rejected(lambda: client.infer("ident_bytes", [tensor]), "400", "input 'IN_BYTES'", "strings")
    tensor = httpclient.InferInput("IN_BYTES", [1, 3], "BYTES")
    tensor.set_shared_memory("strings", size)
    rejected(
        lambda: client.infer("ident_bytes", [tensor]),
        "400",
        "input 'IN_BYTES'",
        "hold 4 BYTES elements",
        "needs 3",
    )


def test_http_input_with_output_in_a_region(
    client: httpclient.InferenceServerClient, region: Region
) -> None:
    data = RNG.standard_normal((1, 64)).astype(np.float32)
    handle = region("out", data.nbytes)
    client.register_system_shared_memory("out", key_of(handle), data.nbytes)
    tensor = httpclient.InferInput("IN_FP32", [1, 64], "FP32")
    tensor.set_data_from_numpy(data)
    result = client.infer("ident", [tensor], outputs=[shm_output("OUT_FP32", "out", data.nbytes)])
    assert result.get_output("OUT_FP32")["parameters"]["shared_memory_byte_size"] == data.nbytes
    np.testing.assert_array_equal(
        shm.get_contents_as_numpy(handle, np.float32, [1, 64]).copy(), data
    )


# -- bad references ----------------------------------------------------------------------


def test_bad_references_are_clear_400s_and_the_worker_keeps_serving(
    client: httpclient.InferenceServerClient, region: Region
) -> None:
    data = np.ones((2, 8), np.float32)
    handle = region("small", 128)
    key = key_of(handle)
    client.register_system_shared_memory("small", key, 128)
    output = httpclient.InferRequestedOutput("OUT_FP32")

    rejected(
        lambda: client.infer("ident", [shm_input("IN_FP32", data, "nope")], outputs=[output]),
        "400",
        "input 'IN_FP32'",
        "unknown shared memory region 'nope'",
    )
    rejected(
        lambda: client.infer("ident", [shm_input("IN_FP32", data, "small", offset=96)]),
        "400",
        "input 'IN_FP32'",
        "offset 96 + byte size 64",
        "128 bytes of region 'small'",
    )
    wrong_size = httpclient.InferInput("IN_FP32", [2, 8], "FP32")
    wrong_size.set_shared_memory("small", 60)
    rejected(
        lambda: client.infer("ident", [wrong_size]),
        "400",
        "input 'IN_FP32'",
        "shared_memory_byte_size is 60",
        "needs 64 bytes",
    )
    big = np.ones((2, 64), np.float32)
    tensor = httpclient.InferInput("IN_FP32", [2, 64], "FP32")
    tensor.set_data_from_numpy(big)
    rejected(
        lambda: client.infer("ident", [tensor], outputs=[shm_output("OUT_FP32", "small", 128)]),
        "400",
        "output 'OUT_FP32' needs 512 bytes, region 'small' holds 128",
    )
    rejected(
        lambda: client.infer("ident", [tensor], outputs=[shm_output("OUT_FP32", "small", 64, 96)]),
        "400",
        "output 'OUT_FP32'",
        "region 'small'",
    )
    rejected(
        lambda: client.register_system_shared_memory("small", key, 64),
        "400",
        "shared memory region 'small' already in manager",
    )
    rejected(
        lambda: client.register_system_shared_memory("missing", "/shmtest-does-not-exist", 8),
        "400",
        "Unable to open shared memory region: '/shmtest-does-not-exist'",
    )
    rejected(
        lambda: client.register_system_shared_memory("huge", key, 100, offset=64),
        "400",
        "failed to register shared memory region 'huge': invalid args",
        "offset 64 + byte_size 100 exceeds the 128 bytes",
    )
    rejected(
        lambda: client.register_system_shared_memory("theirs", "/sluice-x-1-in-0", 8),
        "400",
        "as the key contains the reserved prefix 'sluice-'",
    )
    assert [row["name"] for row in client.get_system_shared_memory_status()] == ["small"]
    assert_serving(client)


def test_raw_http_rules_for_references(shm_stack: Stack, region: Region) -> None:
    handle = region("raw", 64)
    with httpx.Client(base_url=shm_stack.url, timeout=10) as http:
        assert (
            http.post(
                "/v2/systemsharedmemory/region/raw/register",
                json={"key": key_of(handle), "offset": 0, "byte_size": 64},
            ).status_code
            == 200
        )
        inp = {"name": "IN_FP32", "shape": [1, 4], "datatype": "FP32"}
        cases: list[tuple[dict[str, Any], list[dict[str, Any]] | None, str]] = [
            (
                {**inp, "parameters": {"shared_memory_region": "raw"}},
                None,
                "'shared_memory_byte_size' must be specified along with 'shared_memory_region'",
            ),
            (
                {
                    **inp,
                    "data": [1, 2, 3, 4],
                    "parameters": {"shared_memory_region": "raw", "shared_memory_byte_size": 16},
                },
                None,
                "But set 'data' 'shared_memory_region'",
            ),
            (
                {**inp, "data": [1, 2, 3, 4]},
                [
                    {
                        "name": "OUT_FP32",
                        "parameters": {
                            "shared_memory_region": "raw",
                            "shared_memory_byte_size": 16,
                            "binary_data": True,
                        },
                    }
                ],
                "cannot also ask for parameters.binary_data",
            ),
        ]
        for tensor, outputs, fragment in cases:
            body: dict[str, Any] = {"inputs": [tensor]}
            if outputs is not None:
                body["outputs"] = outputs
            response = http.post("/v2/models/ident/infer", json=body)
            assert response.status_code == 400, response.text
            assert fragment in response.json()["error"]
        response = http.post("/v2/systemsharedmemory/region/raw2/register", content=b"{")
        assert response.status_code == 400 and "malformed" in response.json()["error"]
        assert http.post("/v2/systemsharedmemory/region/raw/unregister").status_code == 200


@contextmanager
def stopped_worker(stack: Stack, model: str) -> Iterator[None]:
    """The model's worker frozen (SIGSTOP) so that requests wait in its stream."""
    assert stack.process is not None
    (pid,) = procs.worker_pids(stack.process.pid, model)
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def queued_entry(stack: Stack, model: str) -> dict[bytes, bytes]:
    """The newest entry of the model's stream, once there is one."""
    stream = Keys(stack.namespace).request_stream(model, 1)
    with Redis.from_url(stack.redis_url) as redis:
        assert procs.wait_until(lambda: redis.xlen(stream) > 0, 5), "nothing was queued"
        entries = redis.xrange(stream)
    return dict(entries[-1][1])


Call = Callable[[httpclient.InferenceServerClient], Any]


def in_background(stack: Stack, call: Call) -> tuple[threading.Thread, dict[str, Any]]:
    """Run ``call`` with a client of its own (tritonclient's gevent pool stays in one thread)."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            with httpclient.InferenceServerClient(stack.address) as client:
                outcome["result"] = call(client)
        except Exception as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def test_a_region_in_use_stays_until_its_requests_finish(
    client: httpclient.InferenceServerClient, region: Region, shm_stack: Stack
) -> None:
    data = RNG.standard_normal((1, 16)).astype(np.float32)
    handle = region("busy", data.nbytes)
    shm.set_shared_memory_region(handle, [data])
    client.register_system_shared_memory("busy", key_of(handle), data.nbytes)
    with stopped_worker(shm_stack, "ident"):
        thread, outcome = in_background(
            shm_stack, lambda other: other.infer("ident", [shm_input("IN_FP32", data, "busy")])
        )
        queued_entry(shm_stack, "ident")
        client.unregister_system_shared_memory("busy")  # accepted while a request holds it
        assert [row["name"] for row in client.get_system_shared_memory_status()] == ["busy"]
        rejected(  # (as Triton: the name is taken until the region goes)
            lambda: client.register_system_shared_memory("busy", key_of(handle), data.nbytes),
            "400",
            "shared memory region 'busy' already in manager",
        )
    thread.join(10)
    assert "error" not in outcome, outcome
    np.testing.assert_array_equal(outcome["result"].as_numpy("OUT_FP32"), data)
    assert client.get_system_shared_memory_status() == []


# -- large tensors without client shared memory ----------------------------------------


def test_large_http_tensor_crosses_to_the_worker_through_a_segment(
    client: httpclient.InferenceServerClient, shm_stack: Stack
) -> None:
    data = RNG.standard_normal((2, 1 << 20)).astype(np.float32)  # 8 MiB
    tensor = httpclient.InferInput("IN_FP32", list(data.shape), "FP32")
    tensor.set_data_from_numpy(data)
    assert shm_stack.process is not None
    gateways = procs.gateway_pids(shm_stack.process.pid)
    with stopped_worker(shm_stack, "ident"):
        thread, outcome = in_background(shm_stack, lambda other: other.infer("ident", [tensor]))
        entry = queued_entry(shm_stack, "ident")
        header = msgpack.unpackb(entry[b"h"])
        assert len(entry[b"d"]) == 0  # no tensor bytes in Redis
        name, datatype, shape, nbytes, (key, offset, size) = header["i"][0]
        assert (name, datatype, shape) == ("IN_FP32", "FP32", list(data.shape))
        assert (nbytes, offset, size) == (data.nbytes, 0, data.nbytes)
        prefix = segment_prefix(shm_stack.namespace)
        assert any(key.startswith(f"{prefix}{gateway}-in-") for gateway in gateways), key
        assert segments(shm_stack) == [key]
        assert header["sm"] == 64 * 1024 + 1  # and the answer comes back the same way
    thread.join(30)
    np.testing.assert_array_equal(outcome["result"].as_numpy("OUT_FP32"), data)
    assert procs.wait_until(lambda: segments(shm_stack) == [], 5), segments(shm_stack)


def test_cuda_shared_memory_answers_clearly_without_a_gpu(
    client: httpclient.InferenceServerClient, shm_stack: Stack
) -> None:
    raw = base64.b64encode(b"\x01" * 64)
    with httpx.Client(base_url=shm_stack.url, timeout=10) as http:
        response = http.post(
            "/v2/cudasharedmemory/region/gpu/register",
            json={"raw_handle": {"b64": raw.decode()}, "device_id": 0, "byte_size": 1024},
        )
        bad = http.post(
            "/v2/cudasharedmemory/region/gpu/register",
            json={"raw_handle": {"b64": "AAAA"}, "device_id": 0, "byte_size": 1024},
        )
    assert bad.status_code == 400 and "64" in bad.json()["error"]
    if response.status_code == 400:  # a GPU host with cuda-python: the forged handle fails
        assert "invalid args: opening the CUDA IPC handle" in response.json()["error"]
        return
    assert response.status_code == 501
    assert "NVIDIA GPU and the cuda-python package" in response.json()["error"]
    assert client.get_cuda_shared_memory_status() == []
    client.unregister_cuda_shared_memory()
    client.unregister_cuda_shared_memory("gpu")
    assert_serving(client)


# -- several hosts: the gateway moves the bytes -----------------------------------------


def test_across_hosts_regions_work_and_no_segment_is_made(
    tmp_path: Path, start_stack: Callable[..., Stack], region: Region
) -> None:
    stack = start_stack(
        build_repository(tmp_path),
        env={**SAME_HOST, "SLUICE_SHM_SAME_HOST": "false"},
    )
    data = RNG.standard_normal((2, 300_000)).astype(np.float32)
    handle = region("in", data.nbytes)
    out = region("out", data.nbytes)
    shm.set_shared_memory_region(handle, [data])
    with httpclient.InferenceServerClient(stack.address) as client:
        client.register_system_shared_memory("in", key_of(handle), data.nbytes)
        client.register_system_shared_memory("out", key_of(out), data.nbytes)
        with stopped_worker(stack, "ident"):
            thread, outcome = in_background(
                stack,
                lambda other: other.infer(
                    "ident",
                    [shm_input("IN_FP32", data, "in")],
                    outputs=[shm_output("OUT_FP32", "out", data.nbytes)],
                ),
            )
            entry = queued_entry(stack, "ident")
            assert len(entry[b"d"]) == data.nbytes  # the bytes travel in the entry
            assert "or" not in msgpack.unpackb(entry[b"h"])
        thread.join(30)
        assert "error" not in outcome, outcome
        got = shm.get_contents_as_numpy(out, np.float32, list(data.shape)).copy()
        np.testing.assert_array_equal(got, data)
        client.unregister_system_shared_memory()
    assert segments(stack) == []


def test_a_worker_on_another_host_turns_shared_memory_off(
    tmp_path: Path, start_stack: Callable[..., Stack]
) -> None:
    """Workers advertise their host; while one of a model's workers is elsewhere, the
    gateway sends that model's tensors in the entry, and uses segments again once every
    worker is back on its host."""
    repository = build_repository(tmp_path)
    stack = start_stack(repository, env=SAME_HOST)
    assert stack.process is not None and stack.redis_url is not None
    keys = Keys(stack.namespace)
    env = dict(
        os.environ,
        SLUICE_REDIS_URL=stack.redis_url,
        SLUICE_NAMESPACE=stack.namespace,
        SLUICE_HOST_ID="another-host",
    )
    argv = ["--model-repository", str(repository), "--model", "ident", "--version", "1"]
    far = subprocess.Popen(
        [sys.executable, "-m", "sluice.workers", *argv, "--kind", "KIND_CPU", "--threads", "1"],
        env=env,
    )
    data = RNG.standard_normal((2, 1 << 20)).astype(np.float32)  # 8 MiB
    tensor = httpclient.InferInput("IN_FP32", list(data.shape), "FP32")
    tensor.set_data_from_numpy(data)
    (near,) = procs.worker_pids(stack.process.pid, "ident")

    def entry_while_frozen(pids: list[int]) -> dict[bytes, bytes]:
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        try:
            thread, outcome = in_background(stack, lambda other: other.infer("ident", [tensor]))
            entry = queued_entry(stack, "ident")
        finally:
            for pid in pids:
                os.kill(pid, signal.SIGCONT)
        thread.join(30)
        np.testing.assert_array_equal(outcome["result"].as_numpy("OUT_FP32"), data)
        return entry

    try:
        with Redis.from_url(stack.redis_url) as redis:
            hosts = keys.worker_hosts("ident", 1)
            assert procs.wait_until(lambda: redis.hlen(hosts) == 2, 30), "no second worker"
            # The gateway looks at the workers' hosts at its refresh.
            assert wait_for_refresh(redis, keys), "the gateway did not refresh"
            entry = entry_while_frozen([near, far.pid])
            header = msgpack.unpackb(entry[b"h"])
            assert len(entry[b"d"]) == data.nbytes and "sp" not in header and "h" not in header
            assert segments(stack) == []
            far.terminate()
            assert far.wait(30) == 0
            assert redis.hlen(hosts) == 1  # it said it left
            assert wait_for_refresh(redis, keys), "the gateway did not refresh"
        entry = entry_while_frozen([near])
        assert len(entry[b"d"]) == 0  # through a segment again
        assert procs.wait_until(lambda: segments(stack) == [], 5), segments(stack)
    finally:
        if far.poll() is None:
            far.kill()
            far.wait()


def test_regions_over_grpc(region: Region, shm_stack: Stack) -> None:
    """The same regions through tritonclient.grpc: registration, status, inputs and outputs
    by reference, unregistration."""
    import tritonclient.grpc as grpcclient

    data = RNG.standard_normal((2, 500)).astype(np.float32)
    size = data.nbytes
    handle = region("grpc-io", 2 * size)
    shm.set_shared_memory_region(handle, [data])
    with grpcclient.InferenceServerClient(shm_stack.grpc_address) as client:
        client.register_system_shared_memory("g-in", key_of(handle), size)
        client.register_system_shared_memory("g-out", key_of(handle), size, offset=size)
        status = client.get_system_shared_memory_status().regions
        assert set(status) == {"g-in", "g-out"}
        assert (status["g-out"].key, status["g-out"].offset) == (key_of(handle), size)
        assert status["g-out"].byte_size == size

        tensor = grpcclient.InferInput("IN_FP32", list(data.shape), "FP32")
        tensor.set_shared_memory("g-in", size)
        output = grpcclient.InferRequestedOutput("OUT_FP32")
        output.set_shared_memory("g-out", size)
        result = client.infer("ident", [tensor], outputs=[output])
        answer = result.get_output("OUT_FP32")
        assert list(answer.shape) == [2, 500]
        assert answer.parameters["shared_memory_region"].string_param == "g-out"
        assert list(result.get_response().raw_output_contents) == [b""]
        got = shm.get_contents_as_numpy(handle, np.float32, [2, 500], offset=size)
        np.testing.assert_array_equal(got, data)
        del got

        with pytest.raises(InferenceServerException) as unknown:
            client.get_system_shared_memory_status("nope")
        assert "'nope'" in unknown.value.message()
        client.unregister_system_shared_memory("g-in")
        assert set(client.get_system_shared_memory_status().regions) == {"g-out"}
        client.unregister_system_shared_memory()
        assert client.get_system_shared_memory_status().regions == {}
        with pytest.raises(InferenceServerException) as cuda:
            client.register_cuda_shared_memory("c", base64.b64encode(b"\1" * 64), 0, 16)
        # (a machine with a GPU would get further: the handle is not a real one)
        assert cuda.value.status() in ("StatusCode.UNIMPLEMENTED", "StatusCode.INVALID_ARGUMENT")
        assert client.get_cuda_shared_memory_status().regions == {}
