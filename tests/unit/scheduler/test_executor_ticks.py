"""The executor's tick loop: an unexpected error in one tick is logged with its traceback,
and the loop goes on (the other steps of that tick too); a wake-up ends its wait at once."""

from __future__ import annotations

import logging
import threading

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from sluice.scheduler.executor.ticks import Wakeup, guarded, run_ticks


def test_an_unexpected_error_is_logged_with_its_traceback_and_the_loop_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    stop = threading.Event()
    calls = {"broken": 0, "healthy": 0}

    def broken() -> None:
        calls["broken"] += 1
        raise RuntimeError("a bug in one step")

    def healthy() -> None:
        calls["healthy"] += 1
        if calls["healthy"] >= 3:
            stop.set()

    caplog.set_level(logging.ERROR, logger="sluice.up")
    run_ticks([broken, healthy], stop, every_s=0.001)
    assert calls == {"broken": 3, "healthy": 3}
    failures = [r for r in caplog.records if r.name == "sluice.up"]
    assert len(failures) == 3
    assert "an executor tick failed" in failures[0].getMessage()
    assert failures[0].exc_info is not None
    assert "a bug in one step" in caplog.text


def test_a_redis_error_is_a_warning_without_traceback(caplog: pytest.LogCaptureFixture) -> None:
    def unreachable() -> None:
        raise RedisConnectionError("connection refused")

    caplog.set_level(logging.WARNING, logger="sluice.up")
    guarded(unreachable)
    [record] = caplog.records
    assert record.levelno == logging.WARNING
    assert record.getMessage() == "Redis: connection refused"
    assert record.exc_info is None


def test_a_wakeup_ends_the_wait_at_once_and_ticks_are_slow_while_idle() -> None:
    stop = threading.Event()
    wake = Wakeup()
    ticks: list[int] = []

    def tick() -> None:
        ticks.append(1)
        if len(ticks) == 3:
            stop.set()
            wake.set()  # as the signal handler does
        else:
            wake.set()  # (a child exited, a command arrived)

    runner = threading.Thread(
        target=run_ticks,
        args=([tick], stop),
        kwargs={"wake": wake, "busy": lambda: False, "idle_s": 3600.0},
    )
    runner.start()
    wake.set()
    # Idle ticks are an hour apart: only the wake-ups make these three ticks.
    runner.join(60)
    assert not runner.is_alive()
    assert len(ticks) == 3


def test_a_wakeup_set_before_the_wait_is_kept_until_cleared() -> None:
    wake = Wakeup()
    wake.set()
    wake.set()
    wake.wait(60)  # returns at once: it was set
    wake.clear()
    wake.wait(0)  # cleared: times out at once
