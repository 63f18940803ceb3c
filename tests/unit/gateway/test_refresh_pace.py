"""The gateway's periodic refresh slows down while no request arrives and resumes its pace
when requests do (on a fake clock: nothing here depends on the machine's speed)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from pydantic import ValidationError

from sluice.core.settings import GatewaySettings
from sluice.gateway import catalog_refresh
from sluice.gateway.admission import Admission


class Stop(Exception):
    pass


async def refreshes(monkeypatch: pytest.MonkeyPatch, arrivals: list[int]) -> list[float]:
    """When the loop refreshed, over ``len(arrivals)`` ticks of 0.5 s; ``arrivals[i]``
    requests arrive during tick ``i``."""
    clock = [0.0]
    done: list[float] = []
    admission = Admission(max_in_flight=10)
    ticks = iter(arrivals)

    async def sleep(seconds: float) -> None:
        clock[0] += seconds
        try:
            admission.arrived += next(ticks)
        except StopIteration:
            raise Stop from None

    async def refresh(state: Any, dispatcher: Any, touch: bool) -> None:
        done.append(clock[0])

    monkeypatch.setattr(catalog_refresh, "asyncio", SimpleNamespace(sleep=sleep))
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
    # Idle for 1.5 s, then a request in each of four ticks, then idle again.
    done = await refreshes(monkeypatch, [0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0])
    assert done == [2.0, 2.5, 3.0, 3.5, 5.5]


@pytest.mark.parametrize("value", ["0", "-1", "5", "soon"])
def test_a_bad_idle_refresh_is_refused_naming_it(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv("SLUICE_CATALOG_IDLE_REFRESH_S", value)
    with pytest.raises(ValidationError, match="catalog_idle_refresh_s"):
        GatewaySettings()
