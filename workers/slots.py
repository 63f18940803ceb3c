"""How many batches one model instance computes at once.

Most backends compute one batch at a time on one compute thread: the worker gates the
next batch on an :class:`asyncio.Event` (``idle``), set while the thread is free. A backend
that mostly waits on something else (an ensemble waits on its composing models) declares
``concurrency = N``; its worker then keeps up to N batches in flight, gated by
:class:`ComputeSlots`, which offers the same four calls as the event with a count behind
them, and computes them on N threads (see :mod:`sluice.workers.worker`).

Threads rather than coroutines on the worker's loop: every backend keeps one synchronous
interface, and the work around ``infer`` (combining and splitting a batch's tensors,
proportional to their size) stays off the event loop, as for every other backend.
"""

from __future__ import annotations

import asyncio

from sluice.core.errors import InvalidConfig

MAX_CONCURRENCY = 1024
"""Upper bound on a backend's declared concurrency (threads, open requests)."""


class ComputeSlots:
    """N compute slots: ``is_set`` while one is free, ``clear`` takes one, ``set`` gives
    one back, ``wait`` returns once one is free (the calls :class:`asyncio.Event` has)."""

    def __init__(self, count: int) -> None:
        self._free = count
        self._released = asyncio.Event()

    def is_set(self) -> bool:
        return self._free > 0

    def clear(self) -> None:
        self._free -= 1

    def set(self) -> None:
        self._free += 1
        self._released.set()

    async def wait(self) -> bool:
        while self._free <= 0:
            self._released.clear()
            await self._released.wait()
        return True


ComputeGate = asyncio.Event | ComputeSlots
"""Whether the next batch may go: an event for one compute thread, slots for several."""


def backend_concurrency(backend: object) -> int:
    """The batches a backend computes at once: its ``concurrency`` attribute, else 1."""
    value = getattr(backend, "concurrency", 1)
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_CONCURRENCY:
        raise InvalidConfig(
            f"backend {type(backend).__name__}: concurrency must be an integer from 1 to "
            f"{MAX_CONCURRENCY}, got {value!r}"
        )
    return value
