"""The executor's tick loop: every step of ``sluice up``'s upkeep, each guarded, so that one
unexpected error is logged with its trace and the executor goes on (as the controller does):
one bad tick must not stop every child ``sluice up`` runs.

The loop does not poll while nothing happens. It ticks every ``TICK_S`` while something is
in progress (a model loading or draining, a child to restart), else every ``IDLE_TICK_S``;
and what needs an answer at once wakes it before its next tick (:class:`Wakeup`): a child
that exited (SIGCHLD), a command on the control stream (a blocking read on a thread of its
own), a stop."""

from __future__ import annotations

import contextlib
import logging
import os
import select
import threading
from collections.abc import Callable, Sequence
from typing import Any, cast

from redis import Redis
from redis.exceptions import RedisError

log = logging.getLogger("sluice.up")

Tick = Callable[[], object]

TICK_S = 0.1
"""The period while something is in progress (:func:`run_ticks`' ``busy``)."""

IDLE_TICK_S = 1.0
"""The period while nothing is in progress: the catalog check, autoscaling's wanted counts
and the shared memory sweep need no more; children's exits and commands wake the loop."""

_WATCH_BLOCK_MS = 10_000
"""How long one blocking read of the command watcher waits (it wakes this often idle)."""


def guarded(tick: Tick) -> None:
    """Run one step; a Redis error is a warning (Redis comes back, the next tick retries),
    anything else is logged with its traceback."""
    try:
        tick()
    except RedisError as exc:
        log.warning("Redis: %s", exc)
    except Exception:
        log.exception("an executor tick failed (%s); going on", _name(tick))


class Wakeup:
    """Ends the tick loop's wait early. :meth:`set` writes a byte on a pipe and takes no
    lock, so a signal handler may call it (a handler that set a :class:`threading.Event`
    could interrupt the main thread while it holds that event's lock, and wait forever)."""

    def __init__(self) -> None:
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)

    def set(self) -> None:
        with contextlib.suppress(OSError):  # full (already woken) or closed
            os.write(self._write, b"\0")

    def wait(self, timeout_s: float) -> None:
        """Until :meth:`set` or ``timeout_s``; what was set stays set until :meth:`clear`."""
        select.select([self._read], [], [], timeout_s)

    def clear(self) -> None:
        with contextlib.suppress(OSError):
            while os.read(self._read, 4096):
                pass


def run_ticks(
    ticks: Sequence[Tick],
    stop: threading.Event,
    every_s: float = TICK_S,
    *,
    wake: Wakeup | None = None,
    busy: Callable[[], bool] | None = None,
    idle_s: float = IDLE_TICK_S,
) -> None:
    """Run every step in order until ``stop`` is set: every ``every_s`` seconds, or (with
    ``wake``) every ``every_s`` while ``busy()`` and every ``idle_s`` otherwise, and at once
    whenever ``wake`` is set (whoever sets ``stop`` sets ``wake`` too)."""
    if wake is None:
        while not stop.wait(every_s):
            for tick in ticks:
                guarded(tick)
        return
    while not stop.is_set():
        wake.wait(every_s if busy is None or _busy(busy) else idle_s)
        if stop.is_set():
            return
        wake.clear()  # before the steps: a wake-up while they run is not lost
        for tick in ticks:
            guarded(tick)


def _busy(busy: Callable[[], bool]) -> bool:
    try:
        return busy()
    except Exception:
        log.exception("an executor tick failed (busy); going on")
        return True


class CommandWatch:
    """Wakes the tick loop when a command arrives on the control stream (or a gateway asks
    for an on-demand model): one blocking read (``XREAD BLOCK``) after another, on a thread
    and a connection of its own. It reads only to notice: the tick loop acts."""

    def __init__(
        self,
        connect: Callable[[float], Redis],
        streams: Sequence[str],
        wake: Wakeup,
        stop: threading.Event,
        block_ms: int = _WATCH_BLOCK_MS,
    ) -> None:
        """``connect(socket_timeout_s)``: a new client (the watcher's own)."""
        self.connect, self.streams, self.wake, self.stop = connect, streams, wake, stop
        self.block_ms = block_ms
        self.thread = threading.Thread(target=self._run, name="command-watch", daemon=True)

    def start(self) -> CommandWatch:
        self.thread.start()
        return self

    def _run(self) -> None:
        client = self.connect(self.block_ms / 1000 + 5)
        # From what is there at start on ("$" would miss what comes between two reads).
        last: dict[Any, str] = {stream: "0-0" for stream in self.streams}
        try:
            while not self.stop.is_set():
                try:
                    found = cast(
                        list[Any], client.xread(cast(Any, last), count=16, block=self.block_ms)
                    )
                except RedisError:
                    self.stop.wait(1.0)  # the tick loop reports Redis's state
                    continue
                for stream, entries in found or []:
                    if entries:
                        name = stream.decode() if isinstance(stream, bytes) else stream
                        last[name] = entries[-1][0].decode()
                        self.wake.set()
        finally:
            client.close()


def _name(tick: Tick) -> str:
    return getattr(tick, "__qualname__", None) or repr(tick)
