"""Does one heavy request stall everyone else? Probe liveness while it runs."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TypeVar

import httpx

T = TypeVar("T")


def probe_while(url: str, heavy: Callable[[], T], timeout_s: float = 120.0) -> tuple[T, int, float]:
    """Run ``heavy()`` on a thread and ``GET /v2/health/live`` back to back until it
    returns: (its result, probes made, slowest probe in seconds)."""
    result: list[T] = []
    thread = threading.Thread(target=lambda: result.append(heavy()))
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
    assert result, "the heavy request did not finish"
    print(f"{probes} health probes during the heavy request, slowest {slowest * 1000:.0f} ms")
    return result[0], probes, slowest
