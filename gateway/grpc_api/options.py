"""The channel arguments of the gateway's gRPC server: message sizes, streams per
connection, flow control and keepalive.

Flow control: a stream's window is grpc's 64 KiB look-ahead, not grown by bandwidth-delay
probing, so a call whose message is not being read yet (it waits for its turn, see
:mod:`sluice.gateway.grpc_api.limits`) holds at most that much in the gateway. A message being
read gets a window of its whole announced size from grpcio itself, so large messages still
arrive at full speed.

Streams: a call's stream counts against ``SLUICE_GRPC_MAX_STREAMS_PER_CONNECTION`` until
grpcio has let go of the finished call, which it does on the event loop after the answer
has left. A busy loop lags behind, and a client that starts its next call as soon as an
answer arrives (any closed-loop client) has calls refused (RST_STREAM, REFUSED_STREAM:
UNAVAILABLE at the client) while it keeps fewer open than the limit. grpc's allowance for
such finished calls (``grpc.http2.max_deallocating_streams``, a few by default) is raised to
the limit itself: a connection holds at most twice the limit of streams, the finished ones
without a flow-control window.

Keepalive: the gateway pings connections that have calls open and closes those whose peer
does not answer; connections without calls are closed after an idle time. By Triton's (and
grpc's) defaults, clients that ping more often than every five minutes without sending
anything, or ping a connection without calls, are sent away after two such pings; Triton's
flags change the three (``SLUICE_GRPC_KEEPALIVE_PERMIT_WITHOUT_CALLS``,
``SLUICE_GRPC_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS``,
``SLUICE_GRPC_HTTP2_MAX_PING_STRIKES``).
"""

from __future__ import annotations

from sluice.core.settings import GatewaySettings

from .limits import GrpcLimits

STREAM_WINDOW_BYTES = 64 * 1024


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


def server_options(settings: GatewaySettings, limits: GrpcLimits) -> list[tuple[str, int]]:
    return [
        ("grpc.so_reuseport", 1 if settings.grpc_reuse_port else 0),
        ("grpc.max_receive_message_length", limits.receive_bytes),
        ("grpc.max_send_message_length", settings.grpc_max_send_message_bytes),
        ("grpc.max_concurrent_streams", settings.grpc_max_streams_per_connection),
        ("grpc.http2.max_deallocating_streams", settings.grpc_max_streams_per_connection),
        ("grpc.http2.bdp_probe", 0),
        ("grpc.http2.lookahead_bytes", STREAM_WINDOW_BYTES),
        ("grpc.keepalive_time_ms", _ms(settings.grpc_keepalive_time_s)),
        ("grpc.keepalive_timeout_ms", _ms(settings.grpc_keepalive_timeout_s)),
        ("grpc.keepalive_permit_without_calls", int(settings.grpc_keepalive_permit_without_calls)),
        ("grpc.http2.max_pings_without_data", 0),
        (
            "grpc.http2.min_ping_interval_without_data_ms",
            settings.grpc_http2_min_recv_ping_interval_without_data_ms,
        ),
        ("grpc.http2.max_ping_strikes", settings.grpc_http2_max_ping_strikes),
        ("grpc.max_connection_idle_ms", _ms(settings.grpc_max_connection_idle_s)),
    ]
