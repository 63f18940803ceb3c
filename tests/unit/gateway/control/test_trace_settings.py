"""Triton's trace extension as Sluice answers it (sluice.gateway.control.trace_settings):
the settings report what this process does, not what it was asked to do."""

from __future__ import annotations

from typing import Any, cast

from sluice.core.settings import GatewaySettings
from sluice.gateway.control.trace_settings import trace_settings
from sluice.gateway.state import GatewayState
from tests.support.onnx_models import identity_config
from tests.unit.gateway.in_process import EchoDispatcher, in_process_gateway


def gateway_state(settings: GatewaySettings) -> GatewayState:
    config = identity_config("ident", ["FP32"], [-1], 8)
    app = in_process_gateway("ident", config, EchoDispatcher(["OUT_FP32"]), settings=settings)
    state: GatewayState = app.app.state.sluice
    return state


def test_trace_level_says_whether_spans_are_exported() -> None:
    """An endpoint is set but OpenTelemetry is not installed: tracing is off (said in the
    log at start), and the trace level says so instead of TIMESTAMPS."""
    state = gateway_state(GatewaySettings(SLUICE_OTLP_ENDPOINT="http://collector:4318"))
    assert state.settings.otlp_endpoint and state.tracing is None
    assert trace_settings(state)["trace_level"] == ["OFF"]
    assert trace_settings(state, "ident")["trace_level"] == ["OFF"]
    state.tracing = cast(Any, object())  # (what the lifespan sets when spans are exported)
    assert trace_settings(state)["trace_level"] == ["TIMESTAMPS"]
