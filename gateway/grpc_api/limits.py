"""What bounds the gRPC server's memory and streams, worked out once from the settings.

grpcio reads a whole request message into memory before a handler sees it, so the body
budget (:class:`sluice.gateway.body_budget.BodyBudget`, shared with HTTP) can only be
charged once a message has arrived. What may be arriving at once is bounded apart:

- a ModelInfer call takes one of ``concurrent_receives`` turns before its message is read
  (HTTP/2 flow control holds the bytes of the calls waiting for one at the client);
- an open ModelStreamInfer stream has at most one message arriving, and at most
  ``open_streams`` streams are open (of which one named tenant's at most
  ``tenant_open_streams``: one tenant's idle streams cannot hold every place);
- each message is at most ``receive_bytes`` (gRPC refuses a larger one itself).

By default both counts are ``max_buffered_body_bytes / receive_bytes``, so the gateway holds
at most about three budgets of request bytes (the budget, the messages arriving on unary
calls, those arriving on streams), whatever the clients send.
"""

from __future__ import annotations

from dataclasses import dataclass

from sluice.core.settings import GatewaySettings

GRPC_MAX_MESSAGE = (1 << 31) - 1
"""The largest message length gRPC can be given."""


@dataclass(frozen=True)
class GrpcLimits:
    receive_bytes: int
    """Largest request message (``grpc.max_receive_message_length``)."""
    concurrent_receives: int
    """ModelInfer messages arriving at once, all calls together."""
    open_streams: int
    """ModelStreamInfer streams open at once."""
    tenant_open_streams: int
    """Of those, one named tenant's (the anonymous tenant has them all)."""
    receive_timeout_s: float
    """How long a ModelInfer call may wait for its turn, and then for its message."""
    stream_idle_s: float
    """A stream quiet for this long (nothing received, nothing under way) is ended."""

    @classmethod
    def from_settings(cls, settings: GatewaySettings) -> GrpcLimits:
        receive = settings.grpc_max_receive_message_bytes
        if receive is None:
            receive = min(settings.max_body_bytes, GRPC_MAX_MESSAGE)
        budget = max(settings.max_buffered_body_bytes, settings.max_body_bytes)
        derived = max(1, budget // receive)
        receives = settings.grpc_max_concurrent_receives or derived
        streams = settings.grpc_max_open_streams or derived
        return cls(
            receive_bytes=receive,
            concurrent_receives=receives,
            open_streams=streams,
            tenant_open_streams=settings.grpc_tenant_max_open_streams or max(1, streams // 2),
            receive_timeout_s=settings.body_timeout_s,
            stream_idle_s=settings.grpc_stream_idle_timeout_s,
        )
