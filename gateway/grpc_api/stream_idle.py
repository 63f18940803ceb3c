"""Reading a ModelStreamInfer stream's next request, ending a stream that has gone quiet.

A stream is quiet while its client sends nothing and none of its requests is under way
(a client waiting for answers is not idle). After ``SLUICE_GRPC_STREAM_IDLE_TIMEOUT_S``
of quiet the stream is ended, so that forgotten or hostile streams give back their place
among the gateway's open streams.
"""

from __future__ import annotations

import asyncio
from http import HTTPStatus

from sluice.core.errors import SluiceError

from .receiving import Context, read_message


class StreamIdle(SluiceError):
    status = HTTPStatus.REQUEST_TIMEOUT
    grpc_code = "DEADLINE_EXCEEDED"


class StreamActivity:
    """When the stream last received a request or finished one, and how many are under way."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.last = self.loop.time()
        self.under_way = 0

    def began(self) -> None:
        self.under_way += 1
        self.last = self.loop.time()

    def ended(self) -> None:
        self.under_way -= 1
        self.last = self.loop.time()

    def quiet_for(self) -> float:
        return 0.0 if self.under_way else self.loop.time() - self.last


async def next_message(context: Context, activity: StreamActivity, idle_s: float) -> bytes | None:
    """The stream's next request message; None once the client has closed its side."""
    read: asyncio.Future[bytes | None] = asyncio.ensure_future(read_message(context))
    try:
        while True:
            left = idle_s - activity.quiet_for()
            if left <= 0:
                raise StreamIdle(
                    f"the stream sent no request for {idle_s:g} s and had none under way "
                    "(SLUICE_GRPC_STREAM_IDLE_TIMEOUT_S); it is closed"
                )
            done, _ = await asyncio.wait((read,), timeout=left)
            if done:
                activity.last = activity.loop.time()
                return read.result()
    finally:
        if not read.done():
            read.cancel()
