"""Triton's trace extension (``GET`` / ``POST /v2[/models/{m}]/trace/setting``, gRPC
``TraceSetting``), answered from Sluice's tracing: OpenTelemetry spans of every request,
exported to ``SLUICE_OTLP_ENDPOINT`` when one is set (see
:mod:`sluice.core.observability.tracing`). The settings are reported under Triton's names
and values; they are fixed by the process's configuration, so a request to change one is
refused (Triton without its tracing build refuses the same way). The REST routes are in
:mod:`sluice.gateway.http.trace_routes`."""

from __future__ import annotations

from typing import Any

from sluice.core.errors import Unsupported
from sluice.gateway.state import GatewayState

FIXED = (
    "trace settings can not be updated through network protocol: Sluice traces every "
    "request with OpenTelemetry to SLUICE_OTLP_ENDPOINT, set when the gateway starts"
)


def trace_settings(state: GatewayState, model: str = "") -> dict[str, list[str]]:
    """The settings, each a list of strings as Triton's; ``model`` (when given) must exist."""
    if model:
        state.view.entry(model)
    # (whether spans are exported: an endpoint without OpenTelemetry installed exports none)
    on = state.tracing is not None
    return {
        "trace_mode": ["opentelemetry"],
        "trace_level": ["TIMESTAMPS"] if on else ["OFF"],
        "trace_rate": ["1"],
        "trace_count": ["-1"],
        "log_frequency": ["0"],
        "trace_file": [""],
    }


def refuse_changes(settings: dict[str, Any]) -> None:
    """A request that names any setting asks to change it: refused."""
    if settings:
        raise Unsupported(FIXED)
