"""Client keepalive pings on the gRPC port, as Triton's flags set them: with Triton's
defaults a client that pings an idle connection every half second is sent away (GOAWAY,
too_many_pings); with ``--grpc-keepalive-permit-without-calls=true
--grpc-http2-min-recv-ping-interval-without-data=100 --grpc-http2-max-ping-strikes=0`` (as
Triton's keepalive guide writes them) the same client keeps its connection."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from sluice.scheduler.executor.redis_server import RedisServer
from tests.support.onnx_models import write_identity
from tests.support.procs import wait_until
from tests.support.stack import Stack

PINGING = [
    ("grpc.keepalive_time_ms", 500),
    ("grpc.keepalive_timeout_ms", 5000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]
"""A client that pings every half second, with or without calls."""
LENIENT = [
    "--grpc-keepalive-permit-without-calls=true",
    "--grpc-http2-min-recv-ping-interval-without-data=100",
    "--grpc-http2-max-ping-strikes=0",
]


def _left_ready(address: str, within_s: float) -> bool:
    """Whether a pinging client's idle connection stops being READY within ``within_s``."""
    states: list[grpc.ChannelConnectivity] = []
    channel = grpc.insecure_channel(address, options=PINGING)
    try:
        grpc.channel_ready_future(channel).result(timeout=30)
        channel.subscribe(states.append, try_to_connect=False)
        return wait_until(
            lambda: bool(states) and states[-1] != grpc.ChannelConnectivity.READY, within_s
        )
    finally:
        channel.close()


@pytest.mark.parametrize(("args", "sent_away"), [([], True), (LENIENT, False)])
def test_a_client_pinging_an_idle_connection(
    tmp_path: Path, redis_server: RedisServer, args: list[str], sent_away: bool
) -> None:
    write_identity(tmp_path, "ident", ["FP32"])
    stack = Stack(tmp_path, redis_server.url, args=args)
    stack.start()
    try:
        assert _left_ready(stack.grpc_address, 6.0) is sent_away
    finally:
        stack.stop()
