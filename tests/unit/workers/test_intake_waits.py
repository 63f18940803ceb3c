"""How a worker's intake waits for more requests while a batch gathers: a short wait sleeps
about one expected gap between arrivals before it reads, never a millisecond at a time for
nothing. (No Redis: only the choice of the sleep.)"""

from __future__ import annotations

import asyncio
import time
from typing import Any, cast

import pytest

from sluice.workers.adaptive import ArrivalRate
from sluice.workers.intake import StreamIntake


def intake_with(arrivals: ArrivalRate) -> StreamIntake:
    unused = cast(Any, None)
    return StreamIntake(
        unused, unused, unused, unused, 1, "w", ["s", "bg"], unused, arrivals, asyncio.Event()
    )


def test_without_arrivals_the_whole_wait_is_slept_at_once() -> None:
    assert intake_with(ArrivalRate()).slice_s(0.05) == pytest.approx(0.05)


def test_under_steady_arrivals_it_looks_about_once_per_arrival() -> None:
    arrivals = ArrivalRate()
    now = time.monotonic()
    for step in range(200):  # 1,000 items/s for 0.2 s
        arrivals.add(1, now - 0.2 + step * 0.001)
    slice_s = intake_with(arrivals).slice_s(0.05)
    assert 0.001 <= slice_s < 0.01


def test_a_wait_under_a_millisecond_only_yields() -> None:
    assert intake_with(ArrivalRate()).slice_s(0.0004) == 0.0
