"""gRPC cannot be used to exhaust the gateway's memory or streams.

A stack with small limits: 4 MiB bodies (so gRPC messages of at most 4 MiB: the receive
limit follows ``SLUICE_MAX_BODY_BYTES``), a 16 MiB body budget (so 4 ModelInfer messages
arriving at once and 4 open streams), 8 calls per connection and a short idle timeout.
A flood of large messages is refused instead of growing the gateway's memory; idle streams
are ended; a full connection queues its further calls while other clients are served.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tritonclient.grpc import service_pb2

from sluice.gateway.grpc_api.wire_fields import varint
from tests.support import procs
from tests.support.onnx_models import write_identity
from tests.support.stack import Stack

MIB = 1 << 20
BODY_LIMIT = 4 * MIB
BUDGET = 16 * MIB
TURNS = BUDGET // BODY_LIMIT
PER_CONNECTION = 8
IDLE_S = 2.0
"""The idle timeout of the stack of the idle-stream test alone: the other tests' streams
wait quietly for as long as a loaded machine makes them, so their stack keeps the default."""
INFER = "/inference.GRPCInferenceService/ModelInfer"
STREAM = "/inference.GRPCInferenceService/ModelStreamInfer"
REFUSED = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED}
LIMITS_NAMED = (
    "SLUICE_MAX_BUFFERED_BODY_BYTES",
    "SLUICE_GRPC_MAX_OPEN_STREAMS",
    # HTTP/2 refuses a stream a connection opens past its limit before it learnt the limit
    "RST_STREAM with error code 7",
)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("grpc_limits")
    write_identity(
        root, "echo", ["FP32"], extra="dynamic_batching { max_queue_delay_microseconds: 2000 }"
    )
    stack = Stack(
        root,
        None,
        env={
            "SLUICE_MAX_BODY_BYTES": str(BODY_LIMIT),
            "SLUICE_MAX_BUFFERED_BODY_BYTES": str(BUDGET),
            "SLUICE_GRPC_MAX_STREAMS_PER_CONNECTION": str(PER_CONNECTION),
        },
        args=["--gateway-processes", "1"],  # (the limits and the memory are one process's)
    )
    stack.start()
    yield stack
    stack.stop()


@pytest.fixture(scope="module")
def idle_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("grpc_idle")
    write_identity(root, "echo", ["FP32"])
    stack = Stack(root, None, env={"SLUICE_GRPC_STREAM_IDLE_TIMEOUT_S": str(IDLE_S)})
    stack.start()
    yield stack
    stack.stop()


def request_bytes(floats: int, request_id: str = "") -> bytes:
    """A ModelInferRequest for ``echo`` of ``floats`` FP32 values, encoded."""
    request = service_pb2.ModelInferRequest(model_name="echo", id=request_id)
    tensor = request.inputs.add(name="IN_FP32", datatype="FP32", shape=[1, floats])
    del tensor
    request.raw_input_contents.append(np.ones(floats, np.float32).tobytes())
    return bytes(request.SerializeToString())


def small_call_works(address: str) -> None:
    with grpcclient.InferenceServerClient(address) as client:
        tensor = grpcclient.InferInput("IN_FP32", [1, 4], "FP32")
        tensor.set_data_from_numpy(np.arange(4, dtype=np.float32).reshape(1, 4))
        result = client.infer("echo", [tensor], client_timeout=30)
        assert result.as_numpy("OUT_FP32").tolist() == [[0, 1, 2, 3]]


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmHWM for pid {pid}")


def reset_peak_rss(pid: int) -> None:
    Path(f"/proc/{pid}/clear_refs").write_text("5")


# -- the receive limit follows the body limit ---------------------------------------------


def test_receive_limit_is_the_body_limit(stack: Stack) -> None:
    with grpc.insecure_channel(stack.grpc_address) as channel:
        infer = channel.unary_unary(INFER)
        answer = service_pb2.ModelInferResponse.FromString(
            infer(request_bytes((BODY_LIMIT - 1024) // 4), timeout=30)
        )
        assert answer.model_name == "echo"
        with pytest.raises(grpc.RpcError) as info:
            infer(request_bytes(BODY_LIMIT // 4 + 16), timeout=30)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert str(BODY_LIMIT) in (info.value.details() or "")
    small_call_works(stack.grpc_address)


def test_control_calls_keep_their_own_smaller_limit(stack: Stack) -> None:
    """2 MiB passes the 4 MiB receive limit but not SLUICE_MAX_CONTROL_BODY_BYTES (1 MiB)."""
    with grpcclient.InferenceServerClient(stack.grpc_address) as client:
        with pytest.raises(Exception) as info:
            client.register_system_shared_memory("r", "k" * (2 << 20), 16)
        assert "SLUICE_MAX_CONTROL_BODY_BYTES" in str(info.value)
        assert client.is_server_live()


# -- a flood of large messages ---------------------------------------------------------------

CALLS = 64
STREAMS = TURNS + 2
PER_STREAM = 6
FLOATS = (BODY_LIMIT - 4096) // 4
BOUND_MIB = 256
"""Peak growth allowed. Request bytes are at most three budgets at once (held, arriving on
calls, arriving on streams: 48 MiB); with their decoded copies, the answers (the model
echoes its input) and the allocator's slack, four times that, and 64 MiB for the
interpreter. Without these limits the same flood grew the gateway by about 650 MiB."""


async def flood(address: str) -> dict[str, Any]:
    message = request_bytes(FLOATS)
    outcomes: dict[str, Any] = {"ok": 0, "refused": 0, "stream_ok": 0, "stream_refused": 0}
    details: set[str] = set()
    channels = [
        grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
        for _ in range(CALLS // PER_CONNECTION)
    ]

    async def one_call(index: int) -> None:
        infer = channels[index % len(channels)].unary_unary(INFER)
        try:
            await infer(message, timeout=60)
            outcomes["ok"] += 1
        except grpc.aio.AioRpcError as exc:
            assert exc.code() in REFUSED, (exc.code(), exc.details())
            details.add(exc.details() or "")
            outcomes["refused"] += 1

    async def one_stream(index: int) -> None:
        async with grpc.aio.insecure_channel(address) as channel:
            call = channel.stream_stream(STREAM)

            async def requests() -> AsyncIterator[bytes]:
                for _ in range(PER_STREAM):
                    yield message

            try:
                async for raw in call(requests(), timeout=60):
                    answer = service_pb2.ModelStreamInferResponse.FromString(raw)
                    if answer.error_message:
                        details.add(answer.error_message)
                        outcomes["stream_refused"] += 1
                    else:
                        outcomes["stream_ok"] += 1
            except grpc.aio.AioRpcError as exc:
                # A stream refused at once may find the client still sending: grpcio's
                # client then fails it on its own side (INTERNAL, "execute_batch").
                if exc.code() is grpc.StatusCode.INTERNAL:
                    assert "execute_batch" in (exc.debug_error_string() or ""), exc
                else:
                    assert exc.code() in REFUSED, (exc.code(), exc.details())
                    details.add(exc.details() or "")
                outcomes["stream_refused"] += 1

    try:
        await asyncio.gather(
            *(one_call(index) for index in range(CALLS)),
            *(one_stream(index) for index in range(STREAMS)),
        )
    finally:
        for channel in channels:
            await channel.close()
    outcomes["details"] = details
    return outcomes


@pytest.mark.timeout(120)
def test_a_flood_of_large_messages_is_refused_not_buffered(stack: Stack) -> None:
    """Two floods: the first peaks within the bound, the second leaves the gateway no
    larger (a finished call must not outlive its answer until a garbage collection)."""
    assert stack.process is not None
    gateway = procs.gateway_pid(stack.process.pid)
    small_call_works(stack.grpc_address)
    reset_peak_rss(gateway)
    before = procs.rss_mb(gateway)
    rounds = []
    for _ in range(2):
        started = time.monotonic()
        outcomes = asyncio.run(flood(stack.grpc_address))
        took = time.monotonic() - started
        growth = peak_rss_mib(gateway) - before
        rounds.append((procs.rss_mb(gateway) - before, growth))
        print(f"\nflood: {outcomes}, peak growth {growth:.0f} MiB in {took:.1f} s")

        assert growth < BOUND_MIB, f"the gateway grew by {growth:.0f} MiB: {outcomes}"
        # Some of the work is served (which of the two kinds depends on which took the
        # budget first, so on how busy the machine is), and the rest refused.
        assert outcomes["ok"] + outcomes["stream_ok"] > 0, outcomes
        assert outcomes["refused"] + outcomes["stream_refused"] > 0
        for text in outcomes["details"]:  # each refusal names the limit that was reached
            assert any(limit in text for limit in LIMITS_NAMED), text
    # The allocator keeps some slack between rounds; finished calls kept until a garbage
    # collection would add several hundred MiB here.
    (after_first, _), (after_second, _) = rounds
    assert after_second - after_first < 128, rounds
    small_call_works(stack.grpc_address)


def _field(number: int, payload: bytes) -> bytes:
    return bytes([(number << 3) | 2]) + varint(len(payload)) + payload


ENTRIES_BOUND_MIB = 96
"""Peak growth allowed for messages of empty entries, one after the other. Decoded as
they came, the 4 MiB of empty outputs grew the gateway by about 1 GiB, the 2 MiB of empty
strings by about 170 MiB and the 2 MiB of dims by about 200 MiB (the protobuf form of
either alone takes some 30)."""


@pytest.mark.timeout(120)
def test_messages_of_empty_entries_do_not_swell_the_gateway(stack: Stack) -> None:
    """Entries of two bytes each: a message of nothing but ``inputs``, ``outputs`` or
    ``raw_input_contents`` is refused once counted, before it is decoded; an input of empty
    ``bytes_contents`` (declared BYTES: it is laid out before the datatype is checked
    against the model's) is laid out without an object kept per string; a shape of a byte
    per dim is refused before it is read."""
    assert stack.process is not None
    gateway = procs.gateway_pid(stack.process.pid)
    small_call_works(stack.grpc_address)
    entries = (BODY_LIMIT - 1024) // 2
    model = _field(1, b"echo")
    floods = [model + bytes([(number << 3) | 2, 0]) * entries for number in (5, 6, 7)]
    strings = entries // 2
    tensor = _field(1, b"IN_FP32") + _field(2, b"BYTES") + _field(3, varint(1) + varint(strings))
    floods.append(model + _field(5, tensor + _field(5, b"\x42\x00" * strings)))
    shape = _field(1, b"IN_FP32") + _field(2, b"FP32") + _field(3, b"\x01" * (2 * strings))
    floods.append(model + _field(5, shape))
    reset_peak_rss(gateway)
    before = procs.rss_mb(gateway)
    with grpc.insecure_channel(stack.grpc_address) as channel:
        infer = channel.unary_unary(INFER)
        for message in floods:
            with pytest.raises(grpc.RpcError) as info:
                infer(message, timeout=60)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    growth = peak_rss_mib(gateway) - before
    print(f"\nempty entries: peak growth {growth:.0f} MiB")
    assert f"'shape' has {2 * strings} dims, more than the limit of 64" in (
        info.value.details() or ""
    )
    assert growth < ENTRIES_BOUND_MIB, f"the gateway grew by {growth:.0f} MiB"
    small_call_works(stack.grpc_address)


# -- streams: idle ones end, their number is bounded ----------------------------------------


class OpenStream:
    """A ModelStreamInfer stream that sends one small request, then nothing until closed."""

    def __init__(self, channel: grpc.aio.Channel, request_id: str, key: str = "") -> None:
        """``key``: the API key the stream is opened with (none: anonymous)."""
        self.closed = asyncio.Event()
        metadata = (("authorization", f"Bearer {key}"),) if key else None
        self.call = channel.stream_stream(STREAM)(self._requests(request_id), metadata=metadata)

    async def _requests(self, request_id: str) -> AsyncIterator[bytes]:
        yield request_bytes(4, request_id)
        await self.closed.wait()

    async def first_answer(self) -> Any:
        raw = await self.call.read()
        assert raw is not grpc.aio.EOF, await self.call.details()
        return service_pb2.ModelStreamInferResponse.FromString(raw)

    async def ending(self) -> tuple[grpc.StatusCode, str]:
        """How the gateway ends the stream (with no further answer)."""
        try:
            assert await self.call.read() is grpc.aio.EOF
        except grpc.aio.AioRpcError as exc:
            return exc.code(), exc.details() or ""
        return await self.call.code(), await self.call.details()


def test_an_idle_stream_is_ended_with_a_reason(idle_stack: Stack) -> None:
    async def run() -> tuple[grpc.StatusCode, str, float]:
        async with grpc.aio.insecure_channel(idle_stack.grpc_address) as channel:
            stream = OpenStream(channel, "first")
            answer = await stream.first_answer()
            assert answer.error_message == "" and answer.infer_response.id == "first"
            quiet_from = time.monotonic()
            code, details = await stream.ending()
            return code, details, time.monotonic() - quiet_from

    code, details, quiet = asyncio.run(run())
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED, details
    assert "SLUICE_GRPC_STREAM_IDLE_TIMEOUT_S" in details
    assert IDLE_S - 0.5 < quiet < IDLE_S * 10


def test_open_streams_are_bounded_and_others_are_served(stack: Stack) -> None:
    async def run() -> None:
        channels = [grpc.aio.insecure_channel(stack.grpc_address) for _ in range(2)]
        streams = [OpenStream(channels[i % 2], f"s{i}") for i in range(TURNS)]
        try:
            for stream in streams:
                assert (await stream.first_answer()).error_message == ""
            extra = OpenStream(channels[0], "one too many")
            code, details = await extra.ending()
            if code is grpc.StatusCode.INTERNAL:
                # Refused while the client was still sending its first request: grpcio's
                # client then fails the call on its own side (a loaded machine's race).
                assert "Internal error from Core" in details, details
            else:
                assert code == grpc.StatusCode.UNAVAILABLE, details
                assert "SLUICE_GRPC_MAX_OPEN_STREAMS" in details
            # Unary calls go on meanwhile, on the same connections and on others.
            infer = channels[1].unary_unary(INFER)
            await infer(request_bytes(4), timeout=10)
            await asyncio.to_thread(small_call_works, stack.grpc_address)
            streams[0].closed.set()  # a stream that ends gives its place back
            await streams[0].call.code()
            again = OpenStream(channels[0], "again")
            assert (await again.first_answer()).infer_response.id == "again"
            again.closed.set()
            await again.call.code()
        finally:
            for stream in streams:
                stream.closed.set()
            for channel in channels:
                await channel.close()

    asyncio.run(run())


@pytest.fixture(scope="module")
def tenants_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """Two tenants, four open streams per gateway process (so two per tenant)."""
    root = tmp_path_factory.mktemp("grpc_tenants")
    write_identity(root, "echo", ["FP32"])
    env = {"SLUICE_API_KEYS": "team-a:key-a,team-b:key-b", "SLUICE_GRPC_MAX_OPEN_STREAMS": "4"}
    stack = Stack(root, None, env=env, args=["--gateway-processes", "1"])
    stack.start()
    yield stack
    stack.stop()


def test_one_tenants_streams_cannot_hold_every_place(tenants_stack: Stack) -> None:
    """Team a's third stream is refused with RESOURCE_EXHAUSTED naming its share; team b
    still opens its two; a stream of a's that ends gives a's place back."""

    async def run() -> None:
        async with grpc.aio.insecure_channel(tenants_stack.grpc_address) as channel:
            a = [OpenStream(channel, f"a{i}", "key-a") for i in range(2)]
            for stream in a:
                assert (await stream.first_answer()).error_message == ""
            code, details = await OpenStream(channel, "a-too-many", "key-a").ending()
            if code is grpc.StatusCode.INTERNAL:  # (refused while the client still sent)
                assert "Internal error from Core" in details, details
            else:
                assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, details
                assert "team-a" in details and "SLUICE_GRPC_TENANT_MAX_OPEN_STREAMS=2" in details
            b = [OpenStream(channel, f"b{i}", "key-b") for i in range(2)]
            for stream in b:
                assert (await stream.first_answer()).error_message == ""
            a[0].closed.set()
            await a[0].call.code()
            again = OpenStream(channel, "a-again", "key-a")
            assert (await again.first_answer()).infer_response.id == "a-again"
            for stream in [*a, *b, again]:
                stream.closed.set()

    asyncio.run(run())


def test_a_full_connection_queues_its_further_calls(stack: Stack) -> None:
    """SLUICE_GRPC_MAX_STREAMS_PER_CONNECTION calls open on one connection (health watches,
    which stay open): the next call on it waits in the client's channel, calls on other
    connections are served, and the waiting call goes once a place is free."""
    with grpc.insecure_channel(stack.grpc_address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        watches = [
            health.Watch(health_pb2.HealthCheckRequest(service="")) for _ in range(PER_CONNECTION)
        ]
        for watch in watches:
            next(watch)  # each is open and has answered
        live = channel.unary_unary("/inference.GRPCInferenceService/ServerLive")
        with pytest.raises(grpc.RpcError) as info:
            live(service_pb2.ServerLiveRequest().SerializeToString(), timeout=1.0)
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        small_call_works(stack.grpc_address)  # another connection
        waiting = live.future(service_pb2.ServerLiveRequest().SerializeToString(), timeout=10)
        watches[0].cancel()
        answer = service_pb2.ServerLiveResponse.FromString(waiting.result())
        assert answer.live
        for watch in watches[1:]:
            watch.cancel()
    assert procs.alive(procs.gateway_pid(stack.process.pid))  # type: ignore[union-attr]
