"""TorchServe's Prometheus names for its inference counters, beside Triton's, when
``SLUICE_TORCHSERVE_METRICS`` is on: dashboards and alerts written for TorchServe's metrics
API (``metrics_mode=prometheus``) find ``ts_inference_requests_total``,
``ts_inference_latency_microseconds`` and ``ts_queue_latency_microseconds`` with their
``model_name``, ``model_version`` and ``hostname`` labels. The numbers are the same
counters Triton's families read (:mod:`sluice.core.observability.statistics`)."""

from __future__ import annotations

import socket

from sluice.core.observability.statistics import count_field, ns_field
from sluice.gateway.metrics.host import escape_label, family
from sluice.gateway.metrics.snapshot import Snapshot

_FAMILIES = (
    ("ts_inference_requests_total", "Total number of inference requests.", None),
    (
        "ts_inference_latency_microseconds",
        "Cumulative inference duration in microseconds",
        ns_field("success"),
    ),
    (
        "ts_queue_latency_microseconds",
        "Cumulative queue duration in microseconds",
        ns_field("queue"),
    ),
)


def torchserve_lines(snapshot: Snapshot, hostname: str | None = None) -> list[str]:
    host = escape_label(hostname or socket.gethostname())
    lines: list[str] = []
    for name, help_text, field in _FAMILIES:
        family(lines, name, help_text, "counter")
        for state in snapshot.versions:
            counters = state.counters
            if field is None:
                value = counters.get(count_field("success"), 0) + counters.get(
                    count_field("fail"), 0
                )
            else:
                value = counters.get(field, 0) // 1000
            labels = (
                f'model_name="{escape_label(state.model)}",model_version="{state.version}",'
                f'hostname="{host}"'
            )
            lines.append(f"{name}{{{labels}}} {value}")
    return lines
