"""Whether this process exports spans, and the one door to OpenTelemetry.

With no OTLP endpoint configured (``SLUICE_OTLP_ENDPOINT``, or the standard
``OTEL_EXPORTER_OTLP_ENDPOINT``) :func:`tracing_from_settings` returns None and nothing of
OpenTelemetry's SDK is imported: the request path pays one ``is None`` check. With one,
:mod:`sluice.core.observability.otel` (the ``tracing`` extra) builds the exporter.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from sluice.core.settings import CommonSettings

if TYPE_CHECKING:
    from sluice.core.observability.otel import Tracing

log = logging.getLogger(__name__)

TRACES_PATH = "/v1/traces"
"""Appended to the endpoint, as OTLP/HTTP exporters do with OTEL_EXPORTER_OTLP_ENDPOINT."""


def traces_endpoint(settings: CommonSettings) -> str:
    """Where spans go (``<endpoint>/v1/traces``), or "" when tracing is off."""
    base = settings.otlp_endpoint.strip()
    return f"{base.rstrip('/')}{TRACES_PATH}" if base else ""


def tracing_from_settings(settings: CommonSettings, role: str) -> Tracing | None:
    """The process's tracer, exporting to the configured collector; None when none is
    configured, or when the ``tracing`` extra is missing (said once, in the log)."""
    endpoint = traces_endpoint(settings)
    if not endpoint:
        return None
    try:
        from sluice.core.observability.otel import Tracing
    except ImportError as exc:
        log.error(
            "tracing is off: an OTLP endpoint is set but OpenTelemetry is not installed "
            "(pip install 'sluice[tracing]'): %s",
            exc,
        )
        return None
    log.info("exporting spans to %s", endpoint)
    return Tracing.exporting(endpoint, service_name=settings.otel_service_name, role=role)
