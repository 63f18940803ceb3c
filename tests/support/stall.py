"""Does one heavy request stall everyone else? Probe liveness while it runs."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

import httpx

T = TypeVar("T")


STALL_SHARE = 0.3
"""A stalled event loop holds one probe for most of the heavy call (counting 16 Mi elements
on the loop held one for 2.6 to 3.5 s of a request of about 4 s); a machine busy with other
work delays probes too, but for a small part of a call that it slows down as well."""


@dataclass
class Probed(Generic[T]):
    result: T
    probes: int
    slowest_s: float
    took_s: float
    """How long the heavy call took."""

    def stall_allowed_s(self, calm_limit_s: float) -> float:
        """The slowest probe allowed: ``calm_limit_s`` (:func:`stall_limit`), or
        :data:`STALL_SHARE` of the heavy call's time where a busy machine made it long."""
        return max(calm_limit_s, STALL_SHARE * self.took_s)


def probe_while(url: str, heavy: Callable[[], T], timeout_s: float = 120.0) -> Probed[T]:
    """Run ``heavy()`` on a thread and ``GET /v2/health/live`` back to back until it
    returns."""
    result: list[T] = []
    failure: list[BaseException] = []
    took_s = [0.0]

    def run() -> None:
        started = time.monotonic()
        try:
            result.append(heavy())
        except BaseException as error:  # handed to the test, which reports it
            failure.append(error)
        took_s[0] = time.monotonic() - started

    thread = threading.Thread(target=run)
    thread.start()
    slowest, probes = 0.0, 0
    with httpx.Client(base_url=url, timeout=30) as http:
        while thread.is_alive() and probes < 1000:
            started = time.monotonic()
            assert http.get("/v2/health/live").status_code == 200
            slowest = max(slowest, time.monotonic() - started)
            probes += 1
            time.sleep(0.02)
    thread.join(timeout_s)
    if failure:
        raise AssertionError(f"the heavy request failed: {failure[0]!r}") from failure[0]
    assert result, "the heavy request did not finish"
    print(
        f"{probes} health probes during the heavy request ({took_s[0]:.2f} s), "
        f"slowest {slowest * 1000:.0f} ms"
    )
    return Probed(result[0], probes, slowest, took_s[0])


def stall_limit(url: str, probes: int = 20) -> float:
    """The slowest a health probe may be while something heavy runs: 0.5 s, or ten times the
    slowest of ``probes`` probes with nothing heavy running, if the machine is that busy
    (a stalled event loop held probes for seconds: 2.6 to 3.5 s on an idle machine)."""
    slowest = 0.0
    with httpx.Client(base_url=url, timeout=30) as http:
        for _ in range(probes):
            started = time.monotonic()
            assert http.get("/v2/health/live").status_code == 200
            slowest = max(slowest, time.monotonic() - started)
            time.sleep(0.02)
    return max(0.5, 10 * slowest)
