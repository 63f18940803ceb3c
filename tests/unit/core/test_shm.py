"""Shared memory pieces in isolation: segments and the sweeper, the wire references,
the gateway's registry and transfer decisions, the worker's access and batching, and
what a client's object may not be (a link, a FIFO, too small, too large)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import msgpack
import numpy as np
import pytest

from sluice.core.config import parse_config_text
from sluice.core.datatypes import serialize_bytes, to_buffer
from sluice.core.errors import Forbidden, InferenceFailed, InvalidInput, NotFound, Unsupported
from sluice.core.settings import GatewaySettings
from sluice.core.shm import (
    SHM_DIR,
    ShmKeyError,
    map_segment,
    new_segment_name,
    object_name,
    pid_namespace,
    segment_prefix,
    sweep_orphans,
    write_segment,
)
from sluice.core.wire import (
    DATA_FIELD,
    HEADER_FIELD,
    MalformedEntry,
    ReplyMessage,
    RequestMessage,
    ShmRef,
    TensorHeader,
    decode_reply,
    decode_request,
    encode_reply,
    encode_request,
)
from sluice.gateway.inference.request import InputTensor, RequestedOutput
from sluice.gateway.shm.registry import RegionRegistry, client_shm_allowed, client_shm_refusal
from sluice.gateway.shm.transfer import TensorTransfer
from sluice.workers.execution import Execution
from sluice.workers.replies import Timing
from sluice.workers.shm_io import SharedObjects
from sluice.workers.tensors import PendingRequest, combine, shape_key, split, validate
from tests.support.samples import TINY_CONFIG

# -------------------------------------------------------------------- sluice.core.shm


def test_keys_name_objects_directly_under_dev_shm() -> None:
    assert object_name("/input_simple") == "input_simple"
    assert object_name("//x") == "x"
    for bad in ("", "/", "..", "/a/b", "a\0b", "x" * 300):
        with pytest.raises(ShmKeyError):
            object_name(bad)


def test_segment_names_carry_namespace_creator_and_kind(tmp_path: Path) -> None:
    prefix = segment_prefix("ns a/b")
    assert prefix == "sluice-ns_a_b-"
    name = new_segment_name(prefix, "in")
    assert name.startswith(f"{prefix}{os.getpid()}-in-")
    assert write_segment(name, [b"abc", memoryview(b"de")], tmp_path) == 5
    mapping = map_segment(name, directory=tmp_path)
    assert bytes(mapping) == b"abcde"
    mapping.close()
    with pytest.raises(FileExistsError):
        write_segment(name, [b"x"], tmp_path)


def _dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_sweeper_removes_what_dead_creators_and_gone_readers_left(tmp_path: Path) -> None:
    prefix = segment_prefix("ns")
    dead, alive, here = _dead_pid(), os.getpid(), pid_namespace()
    names = {
        "dead_in": f"{prefix}{dead}-in-{here}-{'0' * 16}",
        "dead_out": f"{prefix}{dead}-out-{here}-{'1' * 16}",
        "alive_in": f"{prefix}{alive}-in-{here}-{'2' * 16}",
        "alive_out_old": f"{prefix}{alive}-out-{here}-{'3' * 16}",
        "alive_out_new": f"{prefix}{alive}-out-{here}-{'4' * 16}",
        "other_namespace": f"{segment_prefix('ns-2')}{dead}-in-{here}-{'5' * 16}",
        "other_container": f"{prefix}{dead}-in-{here}1-{'6' * 16}",
        "client_object": "sluice-ns-not-a-segment",
    }
    for name in names.values():
        (tmp_path / name).write_bytes(b"x")
    old = time.time() - 100
    for name in names.values():
        if "new" not in name:
            os.utime(tmp_path / name, (old, old))
    os.utime(tmp_path / names["alive_out_new"], None)
    fresh_dead = f"{prefix}{dead}-in-{here}-{'7' * 16}"  # within the grace period
    (tmp_path / fresh_dead).write_bytes(b"x")

    removed = sweep_orphans("ns", max_age_s=50, directory=tmp_path)
    assert sorted(removed) == sorted([names["dead_in"], names["dead_out"], names["alive_out_old"]])
    left = set(os.listdir(tmp_path))
    assert left == {
        names["alive_in"],
        names["alive_out_new"],
        names["other_namespace"],
        names["other_container"],
        names["client_object"],
        fresh_dead,
    }
    assert fresh_dead in sweep_orphans("ns", max_age_s=50, grace_s=0, directory=tmp_path)


# -------------------------------------------------------------------------- wire


def test_references_travel_instead_of_bytes() -> None:
    message = RequestMessage(
        request_key="1",
        reply_to="ns:reply:g",
        inputs=[
            TensorHeader("a", "FP32", (2,), 8),
            TensorHeader("b", "FP32", (4,), 16, ShmRef("/client", 64, 16)),
        ],
        outputs=["y", "z"],
        output_regions={"y": ShmRef("client", 128, 32)},
        segment_prefix="sluice-ns-",
        segment_min_bytes=1025,
    )
    fields = encode_request(message, b"\0" * 8)
    decoded, payload = decode_request(fields)
    assert decoded == message and len(payload) == 8

    reply = ReplyMessage(
        "1",
        1,
        [
            TensorHeader("y", "FP32", (8,), 32, ShmRef("client", 128, 16)),
            TensorHeader("z", "INT8", (3,), 3),
        ],
    )
    assert decode_reply(encode_reply(reply, b"abc"))[0] == reply


def test_version_1_entries_still_decode() -> None:
    header = {"v": 1, "k": "1", "r": "x", "i": [["x", "FP32", [1], 4]], "o": ["y"]}
    message, payload = decode_request({HEADER_FIELD: msgpack.packb(header), DATA_FIELD: b"abcd"})
    assert message.inputs[0].shm is None and bytes(payload) == b"abcd"


def _request_header(**changes: object) -> dict[bytes, bytes]:
    header: dict[str, object] = {
        "v": 2,
        "k": "1",
        "r": "x",
        "i": [["x", "FP32", [1], 4, ["key", 0, 4]]],
        "o": ["y"],
    }
    header.update(changes)
    return {HEADER_FIELD: msgpack.packb(header), DATA_FIELD: b""}


@pytest.mark.parametrize(
    "changes",
    [
        {"i": [["x", "FP32", [1], 4, ["../etc/passwd", 0, 4]]]},
        {"i": [["x", "FP32", [1], 4, ["key", -1, 4]]]},
        {"i": [["x", "FP32", [1], 4, ["key", 0, 8]]]},  # size is not the tensor's
        {"i": [["x", "FP32", [1], 4, ["key", 0]]]},
        {"i": [["x", "FP32", [1], 4, "key"]]},
        {"or": {"y": ["key", True, 4]}},
        {"or": ["y"]},
        {"sp": "/tmp/evil-", "sm": 10},
        {"sp": "sluice-ns-", "sm": -1},
    ],
)
def test_malformed_references_are_rejected(changes: dict[str, object]) -> None:
    with pytest.raises(MalformedEntry):
        decode_request(_request_header(**changes))


# ------------------------------------------------------------ objects for the rest


@pytest.fixture
def shm_object() -> Iterator[tuple[str, Path]]:
    """A client-style POSIX shm object of 4 KiB under /dev/shm."""
    key = f"/shmtest-{uuid.uuid4().hex}"
    path = SHM_DIR / key[1:]
    path.write_bytes(bytes(4096))
    yield key, path
    path.unlink(missing_ok=True)


@pytest.fixture
def namespace() -> Iterator[str]:
    name = f"u{uuid.uuid4().hex[:8]}"
    yield name
    sweep_orphans(name, 0, grace_s=0)
    for entry in os.listdir(SHM_DIR):
        if entry.startswith(segment_prefix(name)):
            os.unlink(SHM_DIR / entry)


def segments_of(namespace: str) -> list[str]:
    return [name for name in os.listdir(SHM_DIR) if name.startswith(segment_prefix(namespace))]


# ------------------------------------------------------------------ the registry


async def test_registration_checks_the_object(shm_object: tuple[str, Path]) -> None:
    key, _ = shm_object
    registry = RegionRegistry()
    await registry.register_system("r", key, 1024, 2048)
    assert await registry.system_status(None) == [
        {"name": "r", "key": key, "offset": 1024, "byte_size": 2048}
    ]
    # Triton's texts first, Sluice's detail after them.
    with pytest.raises(InvalidInput, match=r"^shared memory region 'r' already in manager$"):
        await registry.register_system("r", key, 0, 8)
    with pytest.raises(
        InvalidInput,
        match=r"^Unable to open shared memory region: '/shmtest-missing': no such object",
    ):
        await registry.register_system("s", "/shmtest-missing", 0, 8)
    with pytest.raises(
        InvalidInput,
        match=r"^failed to register shared memory region 's': invalid args: offset 4000 \+ "
        r"byte_size 100 exceeds the 4096 bytes",
    ):
        await registry.register_system("s", key, 4000, 100)
    for reserved, prefix in (
        ("/sluice-ns-1-in-x", "sluice-"),
        ("triton_python_backend_shm_region_7", "triton_python_backend_shm_region_"),
        ("//triton_python_backend_shm_region_7", "triton_python_backend_shm_region_"),
    ):
        with pytest.raises(
            InvalidInput,
            match=f"^cannot register shared memory region 's' with key '{reserved}' as the key "
            f"contains the reserved prefix '{prefix}'",
        ):
            await registry.register_system("s", reserved, 0, 8)
    with pytest.raises(
        InvalidInput, match=r"^cannot register shared memory region 's' - invalid shm key '/a/b'"
    ):
        await registry.register_system("s", "/a/b", 0, 8)
    with pytest.raises(NotFound, match=r"^Unable to find system shared memory region: 's'$"):
        await registry.system_status("s")
    with pytest.raises(
        NotFound,
        match=r"^The region named 'r' is registered as system shared memory, not CUDA shared ",
    ):
        await registry.cuda_status("r")
    with pytest.raises(NotFound, match=r"^Unable to find cuda shared memory region: 'q'$"):
        await registry.cuda_status("q")


@pytest.mark.parametrize(
    ("settings", "allowed"),
    [
        ({}, True),
        ({"http_host": "0.0.0.0"}, False),
        ({"http_host": "0.0.0.0", "admin_keys": "secret"}, True),
        ({"http_host": "0.0.0.0", "allow_client_shm": True}, True),
        ({"allow_client_shm": False}, False),
    ],
)
async def test_client_shared_memory_is_off_where_anyone_could_register(
    settings: dict[str, object], allowed: bool, shm_object: tuple[str, Path]
) -> None:
    explicit = {"http_host": "127.0.0.1", "admin_keys": "", "admin_keys_file": ""}
    gateway = GatewaySettings(**{**explicit, "allow_client_shm": None, **settings})  # type: ignore[arg-type]
    assert client_shm_allowed(gateway) is allowed
    registry = RegionRegistry.from_settings(gateway)
    assert registry.allowed is allowed
    if not allowed:
        with pytest.raises(Forbidden, match="SLUICE_ALLOW_CLIENT_SHM") as info:
            await registry.register_system("r", shm_object[0], 0, 8)
        # The reason given is the true one: disabled explicitly, or the default beyond loopback.
        explicitly = settings.get("allow_client_shm") is False
        assert ("disabled" in info.value.message) is explicitly, info.value.message
        assert ("beyond loopback" in info.value.message) is not explicitly, info.value.message
    else:
        await registry.register_system("r", shm_object[0], 0, 8)


def test_the_refusal_says_why() -> None:
    def refusal(**settings: object) -> str:
        base = {"http_host": "127.0.0.1", "admin_keys": "", "admin_keys_file": ""}
        return client_shm_refusal(GatewaySettings(**{**base, **settings}))  # type: ignore[arg-type]

    assert refusal(allow_client_shm=False) == (
        "Client shared memory is disabled. Start the server with '--allow-client-shm=true' to "
        "enable; this gateway was started with SLUICE_ALLOW_CLIENT_SHM=false"
    )
    beyond = refusal(http_host="0.0.0.0", allow_client_shm=None)
    assert "listens on 0.0.0.0, beyond loopback, without admin keys" in beyond
    assert refusal(allow_client_shm=None) == ""


async def test_references_resolve_within_the_region(shm_object: tuple[str, Path]) -> None:
    key, _ = shm_object
    registry = RegionRegistry()
    await registry.register_system("r", key, 1024, 2048)
    assert registry.resolve("input 'x'", "r", 16, 64) == ShmRef(key, 1040, 64)
    with pytest.raises(InvalidInput, match=r"input 'x': unknown shared memory region 'q'"):
        registry.resolve("input 'x'", "q", 0, 4)
    with pytest.raises(InvalidInput, match=r"offset 2000 \+ byte size 64 is beyond the 2048"):
        registry.resolve("input 'x'", "r", 2000, 64)
    for offset, size in ((0, 10**30), (10**30, 0), (2**64 - 1, 2**64 - 1)):
        with pytest.raises(InvalidInput, match="input 'x'"):
            registry.resolve("input 'x'", "r", offset, size)


async def test_shared_memory_inputs_are_limited_outputs_are_not(
    shm_object: tuple[str, Path],
) -> None:
    key, _ = shm_object
    registry = RegionRegistry(max_input_bytes=1000)
    await registry.register_system("r", key, 0, 4096)
    assert registry.resolve("input 'x'", "r", 0, 1000) == ShmRef(key, 0, 1000)
    with pytest.raises(
        InvalidInput,
        match=r"^input 'x': 1001 bytes in shared memory region 'r' exceed the gateway's limit "
        r"of 1000 bytes per input \(SLUICE_MAX_BODY_BYTES\)$",
    ):
        registry.resolve("input 'x'", "r", 0, 1001)
    assert registry.resolve("output 'y'", "r", 0, 4096, output=True) == ShmRef(key, 0, 4096)


async def test_regions_in_use_are_unregistered_at_once(shm_object: tuple[str, Path]) -> None:
    key, path = shm_object
    path.write_bytes(b"\x05" * 4096)
    registry = RegionRegistry()
    await registry.register_system("r", key, 0, 64)
    await registry.register_system("s", key, 0, 64)
    ref = registry.resolve("input 'x'", "r", 8, 4)  # a request holds this reference
    await registry.unregister_system("r")
    assert [row["name"] for row in await registry.system_status(None)] == ["s"]
    with pytest.raises(InvalidInput, match="unknown shared memory region 'r'"):
        registry.resolve("input 'x'", "r", 8, 4)
    assert registry.read("input 'x'", "r", ref) == b"\x05" * 4  # what was resolved stays
    await registry.register_system("r", key, 64, 64)  # the name is free again
    await registry.unregister_system(None)
    await registry.unregister_system("unknown")  # as Triton: nothing to do
    assert await registry.system_status(None) == []


# ------------------------------------------------------------------ the transfer


def transfer(namespace: str, same_host: bool = True, threshold: int = 1000) -> TensorTransfer:
    return TensorTransfer(RegionRegistry(), segment_prefix(namespace), same_host, threshold)


def tensor(name: str, size: int) -> InputTensor:
    return InputTensor(
        name, "UINT8", (size,), memoryview(bytes(range(256)) * (size // 256 + 1))[:size]
    )


def test_large_inputs_go_through_one_segment(namespace: str) -> None:
    moving = transfer(namespace)
    headers, payload, segment = moving.pack(
        [tensor("a", 2000), tensor("b", 10), tensor("c", 3000)], local=moving.same_host
    )
    assert len(payload) == 10
    assert segments_of(namespace) == [segment]
    assert segment is not None
    assert segment.startswith(f"{segment_prefix(namespace)}{os.getpid()}-in-")
    assert headers[0].shm == ShmRef(segment, 0, 2000)
    assert headers[1].shm is None
    assert headers[2].shm == ShmRef(segment, 2000, 3000)
    data = (SHM_DIR / segment).read_bytes()
    assert data[:2000] == bytes(tensor("a", 2000).data)
    assert data[2000:] == bytes(tensor("c", 3000).data)
    assert (moving.segment_min_bytes, moving.message_prefix) == (1001, segment_prefix(namespace))


@pytest.mark.parametrize(("same_host", "threshold"), [(False, 1000), (True, 0)])
def test_everything_inline_across_hosts_or_without_threshold(
    namespace: str, same_host: bool, threshold: int
) -> None:
    moving = transfer(namespace, same_host, threshold)
    headers, payload, segment = moving.pack([tensor("a", 5000)], local=moving.same_host)
    assert headers[0].shm is None and len(payload) == 5000 and segment is None
    assert segments_of(namespace) == []
    assert moving.segment_min_bytes == 0


def test_no_room_for_a_segment_means_inline(
    namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(*_: object) -> int:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("sluice.gateway.shm.transfer.write_segment", full)
    headers, payload, segment = transfer(namespace).pack(
        [tensor("a", 5000), tensor("b", 7)], local=True
    )
    assert segment is None and [h.shm for h in headers] == [None, None]
    assert payload == bytes(tensor("a", 5000).data) + bytes(tensor("b", 7).data)


async def test_across_hosts_the_gateway_reads_client_regions(
    namespace: str, shm_object: tuple[str, Path]
) -> None:
    key, path = shm_object
    path.write_bytes(b"\x07" * 4096)
    moving = transfer(namespace, same_host=False)
    await moving.regions.register_system("r", key, 0, 4096)
    ref = moving.regions.resolve("input 'a'", "r", 100, 8)
    source = InputTensor("a", "UINT8", (8,), b"", ref, "r")
    headers, payload, segment = moving.pack([source], local=moving.same_host)
    assert headers[0].shm is None and payload == b"\x07" * 8 and segment is None
    assert moving.output_regions([RequestedOutput("y", False, ref, "r")], local=False) == {}


async def test_reply_outputs_from_segments_regions_and_inline(
    namespace: str, shm_object: tuple[str, Path]
) -> None:
    key, path = shm_object
    moving = transfer(namespace)
    await moving.regions.register_system("r", key, 0, 4096)
    region = moving.regions.resolve("output 'b'", "r", 0, 64)
    segment = new_segment_name(moving.prefix, "out")
    write_segment(segment, [b"x" * 40])
    headers = [
        TensorHeader("a", "UINT8", (40,), 40, ShmRef(segment, 0, 40)),
        TensorHeader("b", "UINT8", (16,), 16, region),
        TensorHeader("c", "UINT8", (3,), 3),
    ]
    requested = [
        RequestedOutput("a", True),
        RequestedOutput("b", False, region, "r"),
        RequestedOutput("c", True),
    ]
    assert moving.output_regions(requested, local=True) == {"b": region}
    outputs = moving.unpack(headers, memoryview(b"abc"), requested)
    assert bytes(outputs[0].data) == b"x" * 40
    assert (outputs[1].region, outputs[1].region_bytes, outputs[1].data) == ("r", 16, b"")
    assert bytes(outputs[2].data) == b"abc"
    del outputs
    moving.discard(headers)
    assert segments_of(namespace) == []

    too_big = [TensorHeader("b", "UINT8", (100,), 100, region)]
    with pytest.raises(InvalidInput, match="output 'b' needs 100 bytes, region 'r' holds 64"):
        moving.unpack(too_big, memoryview(b""), requested)
    stranger = [TensorHeader("a", "UINT8", (4,), 4, ShmRef("someone-else", 0, 4))]
    with pytest.raises(InferenceFailed, match="unexpected"):
        moving.unpack(stranger, memoryview(b""), requested)
    moving.discard(stranger)  # not ours: left alone

    across = transfer(namespace, same_host=False)
    across.regions = moving.regions
    (out,) = across.unpack([TensorHeader("b", "UINT8", (3,), 3)], memoryview(b"xyz"), requested)
    assert out.region == "r"
    assert path.read_bytes()[:3] == b"xyz"


# ------------------------------------------------------------------- the worker


def test_the_worker_copies_client_objects_and_follows_replaced_ones(
    shm_object: tuple[str, Path],
) -> None:
    key, path = shm_object
    objects = SharedObjects()
    path.write_bytes(b"a" * 4096)
    assert objects.read(ShmRef(key, 10, 4), "input 'x'") == b"aaaa"
    path.unlink()
    path.write_bytes(b"b" * 4096)  # replaced: another inode under the same key
    assert objects.read(ShmRef(key, 10, 4), "input 'x'") == b"bbbb"
    objects.write(ShmRef(key, 100, 8), memoryview(b"12345678"), "output 'y'")
    assert path.read_bytes()[96:112] == b"bbbb12345678bbbb"
    with pytest.raises(InvalidInput, match="does not exist"):
        objects.check(ShmRef("shmtest-missing", 0, 1), "input 'x'")
    with pytest.raises(InvalidInput, match="holds 4096 bytes, the tensor reaches byte 5000"):
        objects.check(ShmRef(key, 4000, 1000), "input 'x'")
    with open(path, "r+b") as shrink:
        shrink.truncate(64)  # a client shrank its object: an error, no SIGBUS
    for call in (
        lambda: objects.read(ShmRef(key, 10, 100), "input 'x'"),
        lambda: objects.write(ShmRef(key, 10, 100), bytes(100), "output 'y'"),
    ):
        with pytest.raises(InvalidInput, match="holds 64 bytes, the tensor reaches byte 110"):
            call()
    for offset, size in ((0, 10**30), (10**30, 8), (2**63, 2**63)):  # no OverflowError
        with pytest.raises(InvalidInput, match=f"reaches byte {offset + size}"):
            objects.read(ShmRef(key, offset, size), "input 'x'")
        with pytest.raises(InvalidInput, match=f"reaches byte {offset + size}"):
            objects.check(ShmRef(key, offset, size), "input 'x'")
    assert path.stat().st_size == 64


@pytest.fixture
def not_plain(tmp_path: Path) -> Iterator[dict[str, Path]]:
    """Names under /dev/shm that a region may not be: links, a FIFO, a directory."""
    secret = tmp_path / "secret"
    secret.write_bytes(b"s" * 64)
    plain = SHM_DIR / f"shmtest-{uuid.uuid4().hex}"
    plain.write_bytes(b"p" * 64)
    names = {kind: SHM_DIR / f"shmtest-{kind}-{uuid.uuid4().hex}" for kind in _NOT_PLAIN}
    names["symlink"].symlink_to(secret)
    names["symlink_to_object"].symlink_to(plain)
    os.link(plain, names["hard_link"])
    os.mkfifo(names["fifo"])
    names["directory"].mkdir()
    yield names
    for path in names.values():
        if path.is_dir() and not path.is_symlink():
            path.rmdir()
        else:
            path.unlink()
    plain.unlink()


_NOT_PLAIN = ("symlink", "symlink_to_object", "hard_link", "fifo", "directory")


@pytest.mark.parametrize("kind", _NOT_PLAIN)
async def test_a_region_must_be_a_plain_object(kind: str, not_plain: dict[str, Path]) -> None:
    key = "/" + not_plain[kind].name
    why = {"symlink": "symbolic link", "symlink_to_object": "symbolic link"}.get(kind, "")
    why = why or ("hard link" if kind == "hard_link" else "(not a regular file|Is a directory)")
    with pytest.raises(
        InvalidInput, match=f"^Unable to open shared memory region: '{key}': .*{why}"
    ):
        await RegionRegistry().register_system("r", key, 0, 0)  # a FIFO must not hang it either
    ref = ShmRef(key, 0, 8)
    objects = SharedObjects()
    for call in (
        lambda: objects.check(ref, "input 'x'"),
        lambda: objects.read(ref, "input 'x'"),
        lambda: objects.write(ref, b"12345678", "output 'y'"),
        lambda: RegionRegistry.read("input 'x'", "r", ref),
        lambda: RegionRegistry.write("output 'y'", "r", ref, b"12345678"),
    ):
        with pytest.raises(InvalidInput, match=f"'{key}'.*: .*{why}"):
            call()


CONFIG = TINY_CONFIG


def test_worker_reads_and_writes_regions_and_makes_output_segments(
    namespace: str, shm_object: tuple[str, Path]
) -> None:
    key, path = shm_object
    first = np.arange(8, dtype=np.float32).reshape(2, 4)
    second = np.full((1, 4), 9, np.float32)
    path.write_bytes(bytes(to_buffer("FP32", first)) + bytes(4096 - 32))
    segment = new_segment_name(segment_prefix(namespace), "in")
    write_segment(segment, [to_buffer("FP32", second)])
    prefix = segment_prefix(namespace)

    a = RequestMessage(
        "a",
        "r",
        [TensorHeader("x", "FP32", (2, 4), 32, ShmRef(key, 0, 32))],
        ["y"],
        output_regions={"y": ShmRef(key, 1024, 32)},
        segment_prefix=prefix,
    )
    b = RequestMessage(
        "b",
        "r",
        [TensorHeader("x", "FP32", (1, 4), 16, ShmRef(segment, 0, 16))],
        ["y"],
        segment_prefix=prefix,
        segment_min_bytes=16,
    )
    c = RequestMessage(
        "c",
        "r",
        [TensorHeader("x", "FP32", (1, 4), 16)],
        ["y"],
        output_regions={"y": ShmRef(key, 2048, 8)},
        segment_prefix=prefix,
    )
    requests = []
    for message, payload, items in ((a, b"", 2), (b, b"", 1), (c, bytes(16), 1)):
        validate(message, CONFIG)
        requests.append(
            PendingRequest(b"0-1", message, memoryview(payload), items, shape_key(message, CONFIG))
        )
    inputs = combine(requests, CONFIG)
    assert inputs["x"].tolist() == [*first.tolist(), *second.tolist(), [0.0] * 4]
    (a_out, a_data), (b_out, b_data), (c_out, c_data) = split(
        requests, {"y": inputs["x"] * 2}, CONFIG
    )

    assert a_out[0].shm == ShmRef(key, 1024, 32) and a_data == b""
    assert (
        np.frombuffer(path.read_bytes()[1024:1056], np.float32).tolist()
        == (first * 2).reshape(-1).tolist()
    )
    out_ref = b_out[0].shm
    assert out_ref is not None and out_ref.key.startswith(f"{prefix}{os.getpid()}-out-")
    assert b_data == b""
    assert np.frombuffer((SHM_DIR / out_ref.key).read_bytes(), np.float32).tolist() == [18.0] * 4
    # c's output needs 16 bytes, its region holds 8: nothing written, the gateway says so
    assert c_out[0].nbytes == 16 and c_out[0].shm == ShmRef(key, 2048, 8) and c_data == b""
    assert path.read_bytes()[2048:2056] == bytes(8)

    gone = RequestMessage(
        "d", "r", [TensorHeader("x", "FP32", (1, 4), 16, ShmRef("shmtest-gone", 0, 16))], ["y"]
    )
    with pytest.raises(
        InvalidInput, match="input 'x': shared memory key 'shmtest-gone' does not exist"
    ):
        validate(gone, CONFIG)


class _Identity:
    def infer(
        self, inputs: dict[str, np.ndarray], outputs: list[str], request_sizes: object = None
    ) -> dict[str, np.ndarray]:
        return {"y": inputs["x"]}


def test_a_region_that_changed_since_validation_fails_only_its_request(
    shm_object: tuple[str, Path], tmp_path: Path
) -> None:
    key, path = shm_object
    path.write_bytes(np.full(1024, 3, np.float32).tobytes())
    requests = []
    for name in ("a", "b", "c"):
        message = RequestMessage(
            name, "r", [TensorHeader("x", "FP32", (1, 4), 16, ShmRef(key, 0, 16))], ["y"]
        )
        validate(message, CONFIG)
        requests.append(
            PendingRequest(b"0-1", message, memoryview(b""), 1, shape_key(message, CONFIG))
        )
    other = SHM_DIR / f"shmtest-{uuid.uuid4().hex}"
    try:
        other.symlink_to(tmp_path / "anything")  # b's key is a link by the time it is read
        requests[1].message.inputs[0].shm = ShmRef(other.name, 0, 16)
        execution = Execution(CONFIG, 1)
        results = execution.compute(requests, _Identity(), Timing())  # type: ignore[arg-type]
    finally:
        other.unlink()
    assert isinstance(results[1], InvalidInput) and "symbolic link" in results[1].message
    for result in (results[0], results[2]):
        assert not isinstance(result, Exception)
        _, payload = result
        assert np.frombuffer(payload, np.float32).tolist() == [3.0] * 4


BYTES_CONFIG = parse_config_text(
    """
    name: "b"
    platform: "onnxruntime_onnx"
    max_batch_size: 8
    input [ { name: "x" data_type: TYPE_STRING dims: [ -1 ] } ]
    output [ { name: "y" data_type: TYPE_STRING dims: [ -1 ] } ]
    """,
    model_name="b",
)


def test_a_bytes_region_rewritten_since_validation_fails_only_its_request(
    shm_object: tuple[str, Path],
) -> None:
    """The gateway counted a BYTES region's elements when it read the request; by the time
    the worker reads it, its client wrote other length prefixes (as many bytes, another
    number of elements). That request fails with a 400; the others of its batch are
    answered."""
    key, path = shm_object
    two = serialize_bytes([b"abcd", b"efgh"])  # 16 bytes, 2 elements
    path.write_bytes(two + bytes(4096 - len(two)))
    rewritten = serialize_bytes([b"", b"", b"wxyz"])  # 16 bytes, 3 elements
    requests = []
    for name in ("a", "b", "c"):
        message = RequestMessage(
            name, "r", [TensorHeader("x", "BYTES", (1, 2), 16, ShmRef(key, 0, 16))], ["y"]
        )
        validate(message, BYTES_CONFIG)
        requests.append(
            PendingRequest(b"0-1", message, memoryview(b""), 1, shape_key(message, BYTES_CONFIG))
        )
    path.write_bytes(two + rewritten + bytes(4096 - 2 * len(two)))
    requests[1].message.inputs[0].shm = ShmRef(key, 16, 16)  # (as if rewritten in place)
    results = Execution(BYTES_CONFIG, 1).compute(requests, _Identity(), Timing())  # type: ignore[arg-type]
    failed = results[1]
    assert isinstance(failed, InvalidInput), failed
    assert "input 'x'" in failed.message and "3 BYTES elements" in failed.message
    for result in (results[0], results[2]):
        assert not isinstance(result, Exception), result
        _, payload = result
        assert payload == two


async def test_cuda_registration_errors_start_with_tritons_text(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    registry = RegionRegistry()
    handle = b"\x01" * 64
    if importlib.util.find_spec("cuda") is None:  # the machine that runs the tests, usually
        with pytest.raises(
            Unsupported,
            match=r"^failed to register CUDA shared memory region: 'gpu', GPUs not supported: "
            r"CUDA shared memory needs an NVIDIA GPU",
        ):
            await registry.register_cuda("gpu", handle, 0, 1024)
    success = SimpleNamespace(cudaSuccess=0)
    one_gpu = SimpleNamespace(cudaError_t=success, cudaGetDeviceCount=lambda: (0, 1))
    monkeypatch.setattr("sluice.gateway.shm.cuda._runtime", lambda: one_gpu)
    with pytest.raises(
        InvalidInput,
        match=r"^failed to register shared memory region: invalid args: device_id 3 does not "
        r"exist: this host has 1 GPUs$",
    ):
        await registry.register_cuda("gpu", handle, 3, 1024)
    assert await registry.cuda_status(None) == []
