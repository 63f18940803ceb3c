"""The gRPC server's bounds worked out from the settings, the request id read from an
encoded message without decoding it, and the idle stream reader."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from pydantic import ValidationError
from tritonclient.grpc import service_pb2

from sluice.core.settings import MIB, GatewaySettings
from sluice.gateway.grpc_api.limits import GrpcLimits
from sluice.gateway.grpc_api.options import server_options
from sluice.gateway.grpc_api.stream_idle import StreamActivity, StreamIdle, next_message
from sluice.gateway.grpc_api.wire_id import request_id_of


def settings(**values: object) -> GatewaySettings:
    return GatewaySettings(**values)  # type: ignore[arg-type]


def test_the_receive_limit_follows_the_body_limit_unless_set() -> None:
    limits = GrpcLimits.from_settings(settings(max_body_bytes=8 * MIB))
    assert limits.receive_bytes == 8 * MIB
    limits = GrpcLimits.from_settings(
        settings(max_body_bytes=8 * MIB, grpc_max_receive_message_bytes=2 * MIB)
    )
    assert limits.receive_bytes == 2 * MIB
    huge = GrpcLimits.from_settings(settings(max_body_bytes=8 << 30))
    assert huge.receive_bytes == (1 << 31) - 1  # gRPC's largest


def test_turns_and_streams_derive_from_the_body_budget() -> None:
    derived = GrpcLimits.from_settings(
        settings(max_body_bytes=64 * MIB, max_buffered_body_bytes=1024 * MIB)
    )
    assert (derived.concurrent_receives, derived.open_streams) == (16, 16)
    tiny = GrpcLimits.from_settings(settings(max_body_bytes=64 * MIB, max_buffered_body_bytes=1))
    assert (tiny.concurrent_receives, tiny.open_streams) == (1, 1)
    set_apart = GrpcLimits.from_settings(
        settings(grpc_max_concurrent_receives=3, grpc_max_open_streams=500)
    )
    assert (set_apart.concurrent_receives, set_apart.open_streams) == (3, 500)


def test_server_options_bound_streams_windows_and_connections() -> None:
    chosen = settings(max_body_bytes=4 * MIB, grpc_max_streams_per_connection=7)
    options = dict(server_options(chosen, GrpcLimits.from_settings(chosen)))
    assert options["grpc.max_receive_message_length"] == 4 * MIB
    assert options["grpc.max_concurrent_streams"] == 7
    # Finished calls the loop has not let go of yet do not get new ones refused.
    assert options["grpc.http2.max_deallocating_streams"] == 7
    assert options["grpc.http2.bdp_probe"] == 0
    assert options["grpc.http2.lookahead_bytes"] == 64 * 1024
    assert options["grpc.keepalive_time_ms"] == 60_000
    assert options["grpc.max_connection_idle_ms"] == 300_000
    # Client pings: Triton's defaults, and what its flags make of them.
    assert options["grpc.keepalive_permit_without_calls"] == 0
    assert options["grpc.http2.min_ping_interval_without_data_ms"] == 300_000
    assert options["grpc.http2.max_ping_strikes"] == 2
    lenient = settings(
        grpc_keepalive_permit_without_calls=True,
        grpc_http2_min_recv_ping_interval_without_data_ms=5000,
        grpc_http2_max_ping_strikes=0,
    )
    options = dict(server_options(lenient, GrpcLimits.from_settings(lenient)))
    assert options["grpc.keepalive_permit_without_calls"] == 1
    assert options["grpc.http2.min_ping_interval_without_data_ms"] == 5000
    assert options["grpc.http2.max_ping_strikes"] == 0


async def test_the_largest_keepalive_settings_still_start_a_server() -> None:
    """gRPC's channel arguments are C ints: a larger setting made grpcio raise
    OverflowError as the gateway started; the settings now stop at what gRPC takes."""
    largest = settings(
        grpc_keepalive_time_s=2_147_483,
        grpc_keepalive_timeout_s=2_147_483,
        grpc_max_connection_idle_s=2_147_483,
        grpc_http2_min_recv_ping_interval_without_data_ms=(1 << 31) - 1,
        grpc_http2_max_ping_strikes=(1 << 31) - 1,
    )
    server = grpc.aio.server(options=server_options(largest, GrpcLimits.from_settings(largest)))
    server.add_insecure_port("127.0.0.1:0")
    await server.start()
    await server.stop(0)
    for name, value in (
        ("grpc_keepalive_time_s", 2_147_484),
        ("grpc_keepalive_timeout_s", 1e10),
        ("grpc_max_connection_idle_s", 1e10),
        ("grpc_http2_min_recv_ping_interval_without_data_ms", 1 << 31),
        ("grpc_http2_max_ping_strikes", 1 << 31),
    ):
        with pytest.raises(ValidationError, match=name):
            settings(**{name: value})


@pytest.mark.parametrize(
    "request_message",
    [
        service_pb2.ModelInferRequest(model_name="m", model_version="2", id="req-7"),
        service_pb2.ModelInferRequest(model_name="m" * 300, id="é-id"),
        service_pb2.ModelInferRequest(id="only"),
    ],
)
def test_the_request_id_is_read_without_decoding(request_message: object) -> None:
    request = service_pb2.ModelInferRequest()
    request.CopyFrom(request_message)
    request.raw_input_contents.append(b"\0" * 100_000)
    assert request_id_of(request.SerializeToString()) == request.id


@pytest.mark.parametrize(
    "message",
    [
        b"",
        b"\xff",
        b"\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff",
        b"\x1a\x80",
        b"\x0f",
        b"\x0a\x05ab",
    ],
)
def test_a_malformed_message_has_no_id(message: bytes) -> None:
    assert request_id_of(message) == ""
    no_id = service_pb2.ModelInferRequest(model_name="m").SerializeToString()
    assert request_id_of(no_id) == ""


class FakeContext:
    """``context.read()`` of a stream whose client sends what ``sent`` holds, when it
    holds it."""

    def __init__(self) -> None:
        self.sent: asyncio.Queue[object] = asyncio.Queue()

    async def read(self) -> object:
        return await self.sent.get()


def test_a_quiet_stream_is_ended_but_not_one_with_requests_under_way() -> None:
    async def run() -> None:
        context = FakeContext()
        activity = StreamActivity()
        context.sent.put_nowait(b"one")
        assert await next_message(context, activity, 0.2) == b"one"
        activity.began()  # a request under way: waiting for its answer is not idle
        waiting = asyncio.ensure_future(next_message(context, activity, 0.1))
        await asyncio.sleep(0.35)
        assert not waiting.done()
        activity.ended()
        with pytest.raises(StreamIdle) as info:
            await waiting
        assert "SLUICE_GRPC_STREAM_IDLE_TIMEOUT_S" in info.value.message
        assert info.value.grpc_code == "DEADLINE_EXCEEDED"
        context.sent.put_nowait(grpc.aio.EOF)
        assert await next_message(context, StreamActivity(), 1.0) is None

    asyncio.run(run())
