"""The deployment's clock: a process whose own clock is off still reads Redis's time, to
within the fastest recent round trip, so deadlines written on one host hold on another."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from sluice.core.clock import DeploymentClock


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
    clock.observe(0, 1_000_000, 2_000)  # round trip 2 µs: offset 999 µs ± 1 µs
    clock.observe(0, 5_000_000, 1_000_000)  # round trip 1 ms: offset 4.5 ms ± 0.5 ms
    assert clock.offset_ns == 998_000  # the surer one, what it shows for certain
    clock.observe(10_000, 2_010_600, 11_000)  # round trip 1 µs: offset 2 ms ± 0.5 µs
    assert clock.offset_ns == 2_000_100 - 500


def test_a_clock_that_agrees_as_far_as_can_be_measured_is_left_alone() -> None:
    """Processes on Redis's host measure tiny offsets that differ by their round trips;
    they all keep their own (the same) clock, so durations between them stay exact."""
    for sent, redis_time, received in [(0, 3_000, 10_000), (0, 7_000, 10_000), (0, 5, 10)]:
        clock = DeploymentClock()
        clock.observe(sent, redis_time, received)
        assert clock.offset_ns == 0
    behind = DeploymentClock()
    behind.observe(0, -50_000, 10_000)  # Redis 55 µs behind, ± 5 µs: 50 µs for certain
    assert behind.offset_ns == -50_000


def test_old_measurements_are_forgotten() -> None:
    clock = DeploymentClock()
    clock.observe(0, -1_000_000, 0)  # a perfect one, long ago
    for index in range(30):
        clock.observe(index, index + 5_000 + 1_000_000, index + 10_000)
    assert clock.offset_ns == 1_000_000 - 5_000
