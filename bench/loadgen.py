"""Closed-loop and open-loop load generators over keep-alive loopback connections.

Both send one pre-encoded request (:class:`bench.payload.InferRequest`) over and over
and measure with ``time.perf_counter``. A run has a warm-up (not counted), a measured
window of ``duration`` seconds and a bounded drain; requests still in flight
``DRAIN_TIMEOUT`` seconds after the window are cancelled and counted as errors.

* closed loop: ``concurrency`` workers, each with its own connection, send back to
  back; counted are the requests that complete inside the window.
* open loop: requests are scheduled every ``1/rate`` seconds whatever the completions
  (at most ``max_in_flight`` outstanding, one connection each); latency runs from the
  *scheduled* send time, so a stalled server is not hidden by the client waiting for it
  (no coordinated omission); counted are the requests scheduled inside the window.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from time import perf_counter
from typing import Any, TypeVar

import numpy as np
import uvloop

from bench.client import HttpConnection, Target, connect

T = TypeVar("T")

DRAIN_TIMEOUT = 10.0
MAX_ERROR_SAMPLES = 5
RECONNECT_BACKOFF = 0.05  # seconds a closed-loop worker waits after a failed connect

# Called with True when the measured window opens and False when it closes.
WindowHook = Callable[[bool], None]
# Looks at an answered body: None if it is right, else what is wrong with it.
AnswerCheck = Callable[[bytes], str | None]
# One request of a non-HTTP client: None when answered correctly, else what went wrong.
Call = Callable[[], Awaitable[str | None]]


@dataclass
class Recorder:
    """Latencies and errors of the requests that fall inside the measured window."""

    window_start: float
    window_end: float
    latencies: list[float] = field(default_factory=list)  # seconds, successful requests
    errors: int = 0
    error_samples: list[str] = field(default_factory=list)
    last_end: float = 0.0
    ok: frozenset[int] = frozenset({200})
    """Statuses that count as answered (202 for job submissions)."""
    check: AnswerCheck | None = None
    """Also checks the body of an answer with an ``ok`` status."""

    def record(self, key: float, start: float, end: float, status: int, body: bytes) -> None:
        """Count a request if ``key`` (its completion or scheduled time) is in the window."""
        if not self.window_start <= key < self.window_end:
            return
        if status not in self.ok:
            problem: str | None = f"HTTP {status}: {body[:300].decode(errors='replace')}"
        else:
            problem = self.check(body) if self.check is not None else None
        self.outcome(key, start, end, problem)

    def outcome(self, key: float, start: float, end: float, problem: str | None) -> None:
        """Count a request answered right (``problem`` None) or not, if ``key`` is in the window."""
        if not self.window_start <= key < self.window_end:
            return
        self.last_end = max(self.last_end, end)
        if problem is None:
            self.latencies.append(end - start)
        else:
            self.error(problem)

    def error(self, message: str) -> None:
        self.errors += 1
        if len(self.error_samples) < MAX_ERROR_SAMPLES:
            self.error_samples.append(message)


@dataclass
class LoadResult:
    """Raw outcome of one load point, before it is summarised."""

    latencies: list[float]
    errors: int
    error_samples: list[str]
    elapsed: float  # seconds the counted requests span (>= duration)
    dropped: int = 0  # open loop: scheduled in the window but never sent


def _window_hooks(warmup: float, duration: float, hook: WindowHook | None) -> None:
    if hook is not None:
        loop = asyncio.get_running_loop()
        loop.call_later(warmup, hook, True)
        loop.call_later(warmup + duration, hook, False)


async def _send(
    target: Target, connection: HttpConnection | None, raw: bytes
) -> tuple[HttpConnection | None, int, bytes]:
    """One request, reconnecting if needed; status 0 and the reason on a transport error."""
    try:
        if connection is None or connection.closed:
            connection = await connect(target)
        status, body = await connection.request(raw)
        return connection, status, body
    except (OSError, ConnectionError) as exc:
        if connection is not None:
            connection.close()
        return None, 0, f"{type(exc).__name__}: {exc}".encode()
    except asyncio.CancelledError:  # a stuck request at the end of the run
        if connection is not None:
            connection.close()
        raise


async def _drain(tasks: list[asyncio.Task[None]], recorder: Recorder, timeout: float) -> None:
    """Wait for ``tasks``; cancel and count as errors those still running after ``timeout``."""
    if not tasks:
        return
    done, pending = await asyncio.wait(tasks, timeout=max(timeout, 0.0))
    for task in pending:
        task.cancel()
        recorder.error(f"request still in flight {DRAIN_TIMEOUT:g}s after the window closed")
    if pending:
        await asyncio.wait(pending)
    for task in done:
        task.result()  # a bug in the load generator must not pass silently


async def closed_loop(
    target: Target,
    raw: bytes,
    concurrency: int,
    duration: float,
    warmup: float = 1.0,
    on_window: WindowHook | None = None,
    ok: frozenset[int] = frozenset({200}),
    check: AnswerCheck | None = None,
) -> LoadResult:
    """``concurrency`` workers sending back to back; counts completions inside the window."""
    start = perf_counter()
    recorder = Recorder(start + warmup, start + warmup + duration, ok=ok, check=check)

    async def worker() -> None:
        connection: HttpConnection | None = None
        try:
            while (sent := perf_counter()) < recorder.window_end:
                connection, status, body = await _send(target, connection, raw)
                done = perf_counter()
                recorder.record(done, sent, done, status, body)
                if connection is None:
                    await asyncio.sleep(RECONNECT_BACKOFF)
        finally:
            if connection is not None:
                connection.close()

    _window_hooks(warmup, duration, on_window)
    tasks = [asyncio.create_task(worker()) for _ in range(concurrency)]
    await _drain(tasks, recorder, recorder.window_end + DRAIN_TIMEOUT - perf_counter())
    return LoadResult(recorder.latencies, recorder.errors, recorder.error_samples, duration)


async def closed_loop_calls(
    call: Call,
    concurrency: int,
    duration: float,
    warmup: float = 1.0,
    on_window: WindowHook | None = None,
) -> LoadResult:
    """:func:`closed_loop` for any client: ``concurrency`` coroutines awaiting ``call()``
    back to back. An exception it raises counts as an error (its message is sampled) and
    that coroutine waits ``RECONNECT_BACKOFF`` before its next request."""
    start = perf_counter()
    recorder = Recorder(start + warmup, start + warmup + duration)

    async def worker() -> None:
        while (sent := perf_counter()) < recorder.window_end:
            try:
                problem = await call()
            except Exception as exc:  # an error status or a transport error
                done = perf_counter()
                recorder.outcome(done, sent, done, f"{type(exc).__name__}: {exc}")
                await asyncio.sleep(RECONNECT_BACKOFF)
                continue
            done = perf_counter()
            recorder.outcome(done, sent, done, problem)

    _window_hooks(warmup, duration, on_window)
    tasks = [asyncio.create_task(worker()) for _ in range(concurrency)]
    await _drain(tasks, recorder, recorder.window_end + DRAIN_TIMEOUT - perf_counter())
    return LoadResult(recorder.latencies, recorder.errors, recorder.error_samples, duration)


async def open_loop(
    target: Target,
    raw: bytes,
    rate: float,
    duration: float,
    warmup: float = 1.0,
    max_in_flight: int = 256,
    on_window: WindowHook | None = None,
) -> LoadResult:
    """Requests scheduled every ``1/rate`` s; latency from the scheduled time."""
    start = perf_counter()
    recorder = Recorder(start + warmup, start + warmup + duration)
    deadline = recorder.window_end + DRAIN_TIMEOUT
    slots = asyncio.Semaphore(max_in_flight)
    idle: list[HttpConnection] = []
    tasks: list[asyncio.Task[None]] = []

    async def one(scheduled: float) -> None:
        try:
            connection, status, body = await _send(target, idle.pop() if idle else None, raw)
            recorder.record(scheduled, scheduled, perf_counter(), status, body)
            if connection is not None:
                idle.append(connection)
        finally:
            slots.release()

    _window_hooks(warmup, duration, on_window)
    index, dropped = 0, 0
    while (scheduled := start + index / rate) < recorder.window_end:
        now = perf_counter()
        if now >= deadline:  # hopelessly behind: the rest of the window is never sent
            first = max(index, math.ceil((recorder.window_start - start) * rate))
            dropped = max(0, math.ceil((recorder.window_end - start) * rate) - first)
            break
        if scheduled > now:
            await asyncio.sleep(scheduled - now)
        if slots.locked():  # max_in_flight reached: wait, but never past the deadline
            try:
                await asyncio.wait_for(slots.acquire(), deadline - perf_counter())
            except TimeoutError:
                continue  # the deadline check above ends the loop
        else:
            await slots.acquire()
        tasks.append(asyncio.create_task(one(scheduled)))
        if len(tasks) >= 4096:
            tasks = [task for task in tasks if not task.done()]
        index += 1
    await _drain(tasks, recorder, deadline - perf_counter())
    for connection in idle:
        connection.close()
    elapsed = max(duration, recorder.last_end - recorder.window_start)
    return LoadResult(
        recorder.latencies, recorder.errors, recorder.error_samples, elapsed, dropped=dropped
    )


@dataclass
class Trace:
    """Every request of an open loop: when it was due, how long it took, its status."""

    sent: list[tuple[float, float, int]] = field(default_factory=list)
    """(scheduled time from the start, latency, HTTP status)"""

    def answered(self) -> list[float]:
        return [latency for _, latency, status in self.sent if status == 200]

    def refused(self) -> int:
        return sum(1 for _, _, status in self.sent if status != 200)


async def open_loop_phases(
    target: Target, raw: bytes, phases: list[tuple[float, float]], timeout_s: float = 600
) -> Trace:
    """An open loop through ``phases`` of (seconds, requests per second): each request
    goes at its time whatever the answers to the others (a connection each while they are
    in flight), and the trace keeps every one."""
    trace = Trace()
    idle: list[HttpConnection] = []
    start = perf_counter()
    tasks: list[asyncio.Task[None]] = []

    async def one(scheduled: float) -> None:
        connection, status, _ = await _send(target, idle.pop() if idle else None, raw)
        trace.sent.append((scheduled - start, perf_counter() - scheduled, status))
        if connection is not None:
            idle.append(connection)

    offset = 0.0
    for seconds, rate in phases:
        for index in range(int(seconds * rate)):
            scheduled = start + offset + index / rate
            delay = scheduled - perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(scheduled)))
        offset += seconds
    await asyncio.wait_for(asyncio.gather(*tasks), timeout=timeout_s)
    for connection in idle:
        connection.close()
    return trace


def run(coroutine: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine to completion on a fresh uvloop event loop."""
    return uvloop.run(coroutine)


def percentiles_ms(latencies: list[float], points: tuple[float, ...]) -> list[float | None]:
    """Latency percentiles in milliseconds (None when nothing was measured)."""
    if not latencies:
        return [None for _ in points]
    values = np.percentile(np.asarray(latencies) * 1000.0, points)
    return [float(value) for value in values]
