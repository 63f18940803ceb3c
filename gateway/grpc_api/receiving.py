"""Receiving one ModelInfer message in turn, so that messages arriving at once stay bounded.

ModelInfer is served as a client-streaming call (the same bytes on the wire as a unary one)
so that the handler runs before grpcio reads the message: it first takes one of a fixed
number of turns. While it waits, the message stays at the client, held back by HTTP/2 flow
control. Both the wait for a turn and the message's arrival are limited in time, so that
slow or silent clients cannot keep turns from the others.

Messages are read with ``context.read()``, not through the request iterator grpcio hands
the handler: iterating makes an async generator that refers back to its iterator, a cycle
that keeps the finished call (and the request bytes grpcio holds for it) alive until a
full garbage collection, hundreds of MiB after a flood of large calls.
"""

from __future__ import annotations

import asyncio
from http import HTTPStatus
from typing import Any

import grpc

from sluice.core.errors import InvalidInput, ServerBusy, SluiceError

from .limits import GrpcLimits

Context = Any
"""``grpc.aio.ServicerContext`` of a call with requests in bytes."""


class MessageTimeout(SluiceError):
    """The request message did not arrive in time."""

    status = HTTPStatus.REQUEST_TIMEOUT
    grpc_code = "DEADLINE_EXCEEDED"


async def read_message(context: Context) -> bytes | None:
    """The call's next request message; None at the end of the client's side."""
    message = await context.read()
    if message is grpc.aio.EOF:
        return None
    assert isinstance(message, bytes)
    return message


class Receiving:
    def __init__(self, limits: GrpcLimits) -> None:
        self.limits = limits
        self.turns = asyncio.Semaphore(limits.concurrent_receives)

    async def one(self, context: Context) -> bytes:
        """The call's request message, read in turn."""
        limits = self.limits
        wait_s = limits.receive_timeout_s
        try:
            if self.turns.locked():  # (else a turn is taken at once, with no timer to set)
                async with asyncio.timeout(wait_s):
                    await self.turns.acquire()
            else:
                await self.turns.acquire()
        except TimeoutError:
            raise ServerBusy(
                f"the gateway is receiving {limits.concurrent_receives} request messages of up "
                f"to {limits.receive_bytes} bytes, its limit (SLUICE_GRPC_MAX_CONCURRENT_RECEIVES)"
                f", and none ended within {wait_s:g} s; retry later",
                1,
            ) from None
        try:
            async with asyncio.timeout(wait_s):  # (no task made per call, as wait_for would)
                return await _only_message(context)
        except TimeoutError:
            raise MessageTimeout(
                f"the request message did not arrive within {wait_s:g} s (SLUICE_BODY_TIMEOUT_S)"
            ) from None
        finally:
            self.turns.release()


async def _only_message(context: Context) -> bytes:
    """The call's one message; the end of the client's side is read too, before the call
    is answered (grpcio keeps a call's received data while that read is outstanding)."""
    message = await read_message(context)
    if message is None:
        raise InvalidInput("the call carried no ModelInferRequest message")
    if await read_message(context) is not None:
        raise InvalidInput("a ModelInfer call carries one ModelInferRequest message, not more")
    return message
