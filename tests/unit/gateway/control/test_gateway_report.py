"""A gateway's report says which catalog revision its view holds: an executor that unloads
a model waits until every live gateway's does (:mod:`sluice.core.catalog_applied`)."""

from __future__ import annotations

from typing import Any

from sluice.core.catalog_applied import APPLIED_REVISION, REPORT_TTL_S
from sluice.gateway.control.gateway_report import IN_FLIGHT, report
from tests.unit.gateway.in_process import EchoDispatcher, in_process_gateway
from tests.unit.gateway.memory_control_plane import MemoryControlPlane

CONFIG = 'name: "m"\nbackend: "onnxruntime"\nmax_batch_size: 4\n'


async def test_the_report_carries_the_revision_the_view_holds() -> None:
    control = MemoryControlPlane()
    app: Any = in_process_gateway("m", CONFIG, EchoDispatcher(["y"]), control=control)
    state = app.app.state.sluice
    state.view.revision = b"1712345678901234"
    await report(state, "g1", 0.001)
    state.view.revision = b"1712345678901235"  # (refreshed: a catalog change applied)
    await report(state, "g1", 0.001)
    assert [g[APPLIED_REVISION] for g, _ in control.reports] == [
        1712345678901234,
        1712345678901235,
    ]
    assert control.reports[0][0][IN_FLIGHT] == 0
    assert {ttl_s for _, ttl_s in control.reports} == {REPORT_TTL_S}


async def test_a_gateway_that_has_read_no_catalog_reports_no_revision() -> None:
    control = MemoryControlPlane()
    app: Any = in_process_gateway("m", CONFIG, EchoDispatcher(["y"]), control=control)
    state = app.app.state.sluice
    state.view.revision, state.view.loaded = None, False
    await report(state, "g1", 0.0)
    state.view.revision, state.view.loaded = b"not-a-number", True
    await report(state, "g1", 0.0)
    assert all(APPLIED_REVISION not in g for g, _ in control.reports)
