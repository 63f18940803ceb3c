"""A gateway process catches up with the catalog between its periodic refreshes: when
another process of its host moved the change counter, and when a request misses (an
unknown or unready model) while the catalog has changed; misses share one refresh."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from sluice.core.catalog import CatalogEntry
from sluice.core.errors import NotFound
from sluice.gateway.control.catalog_follow import asked_fresh, follow_changes, is_problem
from sluice.gateway.control.catalog_view import CatalogView
from sluice.gateway.control.inspection import model_not_ready
from sluice.gateway.grpc_api.protocol import service_pb2
from sluice.gateway.grpc_api.service import ControlCalls
from sluice.gateway.shm.store import HostCounter
from sluice.gateway.state import GatewayState
from tests.support.onnx_models import identity_config
from tests.unit.gateway.in_process import EchoDispatcher, in_process_gateway
from tests.unit.gateway.memory_control_plane import MemoryControlPlane


@dataclass
class PublishingControl(MemoryControlPlane):
    """Its catalog gains model 'late' (ready) once ``published``; counts the refreshes."""

    published: bool = False
    refreshes: int = 0

    async def refresh_catalog(self, view: CatalogView) -> None:
        self.refreshes += 1
        await asyncio.sleep(0.01)  # (a round trip: concurrent misses wait for this one)
        if self.published:
            view.models["late"] = CatalogEntry("late", (1,), view.models["ident"].config)
            view.ready = {**view.ready, "late": frozenset((1,))}
            view.revision = b"2"


def gateway_state(control: PublishingControl) -> GatewayState:
    config = identity_config("ident", ["FP32"], [-1], 8)
    app = in_process_gateway("ident", config, EchoDispatcher(["OUT_FP32"]), control=control)
    state: GatewayState = app.app.state.sluice
    return state


async def test_a_miss_after_a_change_is_answered_from_the_new_catalog() -> None:
    control = PublishingControl()
    state = gateway_state(control)
    with pytest.raises(NotFound):  # nothing changed: the miss stands
        await asked_fresh(state, lambda: state.view.route("late", None))
    control.published = True
    state.miss_refreshed_at = float("-inf")
    entry, version = await asked_fresh(state, lambda: state.view.route("late", None))
    assert (entry.name, version) == ("late", 1)
    problem = await asked_fresh(state, lambda: model_not_ready(state, "late", None), is_problem)
    assert problem is None


async def test_misses_share_one_refresh_and_are_rate_limited(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # (a minute between refreshes: however slowly this machine runs the two rounds)
    monkeypatch.setattr("sluice.gateway.control.catalog_follow.MISS_REFRESH_S", 60.0)
    control = PublishingControl()
    state = gateway_state(control)

    async def miss() -> None:
        with pytest.raises(NotFound):
            await asked_fresh(state, lambda: state.view.route("nope", None))

    await asyncio.gather(*(miss() for _ in range(50)))
    await asyncio.gather(*(miss() for _ in range(50)))
    assert control.refreshes == 1


async def test_a_change_counted_by_another_process_is_followed_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def no_log_settings(state: GatewayState) -> None:
        pass  # (they live in Redis, which this in-process gateway has none of)

    monkeypatch.setattr(
        "sluice.gateway.control.catalog_follow.follow_log_settings", no_log_settings
    )
    control = PublishingControl()
    state = gateway_state(control)
    mine = HostCounter("unit", "host", tmp_path, topic="changes")
    other = HostCounter("unit", "host", tmp_path, topic="changes")
    state.host_changes, state.host_seen = mine, mine.value()
    try:
        await follow_changes(state)
        assert control.refreshes == 0  # nothing moved: one read of mapped memory
        control.published = True
        other.bump()  # another gateway process loaded 'late'
        await asyncio.gather(*(follow_changes(state) for _ in range(10)))
        assert control.refreshes == 1
        assert state.view.route("late", None)[1] == 1
    finally:
        mine.close()
        other.close()


async def test_statistics_and_trace_settings_of_a_model_loaded_elsewhere_are_answered() -> None:
    """As metadata and readiness: a model another host loaded since the last refresh is
    found by catching up, not answered 404 until the next refresh."""
    for method, path in (
        ("GET", "/v2/models/late/stats"),
        ("GET", "/v2/models/late/versions/1/stats"),
        ("GET", "/v2/models/late/trace/setting"),
        ("POST", "/v2/models/late/trace/setting"),
    ):
        control = PublishingControl(published=True)
        config = identity_config("ident", ["FP32"], [-1], 8)
        app = in_process_gateway("ident", config, EchoDispatcher(["OUT_FP32"]), control=control)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as http:
            response = await http.request(method, path)
        assert response.status_code == 200, response.text

    for call, request in (
        ("ModelStatistics", service_pb2.ModelStatisticsRequest(name="late")),
        ("TraceSetting", service_pb2.TraceSettingRequest(model_name="late")),
    ):
        state = gateway_state(PublishingControl(published=True))
        await getattr(ControlCalls(state), call)(request)
