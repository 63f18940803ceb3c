"""The order in which the requests of one gRPC stream enter their request streams.

A stream's requests are parsed and prepared at the same time (a large one on a thread),
but each is queued only once the one before it is queued or has failed: a client that
sends a sequence's requests back to back gets them computed in the order it sent them,
whatever their sizes, while their parsing still overlaps.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class QueueTurn:
    def __init__(self, before: asyncio.Event | None) -> None:
        self._before = before
        self.done = asyncio.Event()
        """Set once this request is queued, or will never be (the next one may go)."""

    async def queue(self, submit: Coroutine[Any, Any, T]) -> T:
        """Await ``submit`` (a dispatcher's submit) once the request before is queued; let
        the next one go as soon as this one's entry waits in the append batch."""
        try:
            if self._before is not None:
                await self._before.wait()
            task = asyncio.ensure_future(submit)
            # The task runs until its entry is in the append batch (its first wait), before
            # this coroutine resumes: tasks run in the order they were scheduled.
            await asyncio.sleep(0)
        except BaseException:
            submit.close()
            raise
        finally:
            self.done.set()
        return await task
