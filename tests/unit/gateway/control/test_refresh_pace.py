"""The gateway's periodic refresh slows down while no request arrives and resumes its pace
when requests do (on a fake clock: nothing here depends on the machine's speed)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
from pydantic import ValidationError

from sluice.core.settings import GatewaySettings
from sluice.gateway.admission import Admission
from sluice.gateway.control import catalog_refresh


class Stop(Exception):
    pass


async def refreshes(monkeypatch: pytest.MonkeyPatch, arrivals: list[int]) -> list[float]:
    """When the loop refreshed, over ``len(arrivals)`` ticks of 0.5 s; ``arrivals[i]``
    requests arrive during tick ``i`` (an idle loop's wait for the next arrival notices it
    at the end of that tick)."""
    clock = [0.0]
    done: list[float] = []
    admission = Admission(max_in_flight=10)
    ticks = iter(arrivals)

    async def sleep(seconds: float) -> None:
        assert seconds == 0.5
        clock[0] += seconds
        try:
            arrived = next(ticks)
        except StopIteration:
            raise Stop from None
        admission.arrived += arrived
        if arrived:
            admission.arrival.set()  # (what Admission.admit does)

    async def arrives_within(arrival: Any, seconds: float) -> bool:
        assert arrival is admission.arrival
        waited = 0.0
        while waited < seconds and not arrival.is_set():
            await sleep(0.5)
            waited += 0.5
        return bool(arrival.is_set())

    async def refresh(state: Any, dispatcher: Any, touch: bool) -> None:
        done.append(clock[0])

    monkeypatch.setattr(catalog_refresh, "asyncio", SimpleNamespace(sleep=sleep))
    monkeypatch.setattr(catalog_refresh, "_arrives_within", arrives_within)
    monkeypatch.setattr(catalog_refresh, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    monkeypatch.setattr(catalog_refresh, "refresh", refresh)
    state: Any = SimpleNamespace(settings=GatewaySettings(), admission=admission)
    with pytest.raises(Stop):
        await catalog_refresh.refresh_loop(state, None)  # type: ignore[arg-type]
    return done


async def test_an_idle_gateway_refreshes_every_two_seconds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert await refreshes(monkeypatch, [0] * 16) == [2.0, 4.0, 6.0, 8.0]


async def test_requests_bring_back_the_half_second_pace_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Idle for 1.5 s, then a request in each of four ticks, then idle again: the first
    # arrival wakes the idle loop, which refreshes half a second later.
    done = await refreshes(monkeypatch, [0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0])
    assert done == [2.5, 3.0, 3.5, 5.5]


async def test_arrivals_before_the_loop_fell_idle_do_not_wake_its_idle_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Requests in the first two ticks (each refreshed at once), then none: the idle wait
    # starts clean instead of seeing the earlier arrivals as a new one.
    done = await refreshes(monkeypatch, [1, 1, 0, 0, 0, 0, 0, 0, 0, 0])
    assert done == [0.5, 1.0, 3.0, 5.0]


@pytest.mark.parametrize("value", ["0", "-1", "5", "soon"])
def test_a_bad_idle_refresh_is_refused_naming_it(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv("SLUICE_CATALOG_IDLE_REFRESH_S", value)
    with pytest.raises(ValidationError, match="catalog_idle_refresh_s"):
        GatewaySettings()


async def test_the_refresh_steps_run_together_and_all_finish_before_an_error() -> None:
    first_started, second_done = asyncio.Event(), []

    async def first() -> str:
        first_started.set()
        await asyncio.sleep(0.01)
        raise ConnectionError("lost")

    async def second() -> str:
        await first_started.wait()  # (would wait forever if the steps ran one by one)
        await asyncio.sleep(0.02)
        second_done.append(True)
        return "read"

    with pytest.raises(ConnectionError, match="lost"):
        await catalog_refresh._together(second(), first())
    assert second_done == [True]
    assert await catalog_refresh._together(asyncio.sleep(0, "a"), asyncio.sleep(0, "b")) == [
        "a",
        "b",
    ]
