"""The deployment's clock: a process whose own clock is off still reads Redis's time, to
within the fastest recent round trip, so deadlines written on one host hold on another."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from sluice.clock import DeploymentClock


class SkewedRedis:
    """Answers TIME as a server whose clock is ``skew_s`` ahead of this process's."""

    def __init__(self, skew_s: float) -> None:
        self.skew_ns = int(skew_s * 1e9)

    async def time(self) -> tuple[int, int]:
        now = time.time_ns() + self.skew_ns
        return now // 1_000_000_000, (now % 1_000_000_000) // 1_000


def test_a_skewed_host_reads_the_servers_time() -> None:
    clock = DeploymentClock()
    redis: Any = SkewedRedis(-37.5)  # this host's clock runs 37.5 s ahead of Redis's
    asyncio.run(clock.sync(redis))
    assert abs(clock.offset_ns + 37_500_000_000) < 50_000_000
    assert abs(clock.now_ns() - (time.time_ns() - 37_500_000_000)) < 50_000_000


def test_the_fastest_recent_measurement_wins() -> None:
    clock = DeploymentClock()
    clock.observe(0, 1_000, 2_000)  # round trip 2 µs: offset 0
    clock.observe(0, 900_000, 1_000_000)  # round trip 1 ms: offset 400 µs, less sure
    assert clock.offset_ns == 0
    clock.observe(10_000, 10_600, 11_000)  # round trip 1 µs: offset 100 ns
    assert clock.offset_ns == 100


def test_old_measurements_are_forgotten() -> None:
    clock = DeploymentClock()
    clock.observe(0, 0, 0)  # a perfect one, long ago
    for index in range(30):
        clock.observe(index, index + 5_000 + 10, index + 10_000)
    assert clock.offset_ns == 5_000 + 10 - 5_000
