"""TorchServe's Prometheus names for its inference counters, beside Triton's, when
``SLUICE_TORCHSERVE_METRICS`` is on: dashboards and alerts written for TorchServe's metrics
API (``metrics_mode=prometheus``) find ``ts_inference_requests_total``,
``ts_inference_latency_microseconds`` and ``ts_queue_latency_microseconds`` with their
``model_name``, ``model_version`` (TorchServe's version text, ``1.0``) and ``hostname``
labels. The numbers are the same counters Triton's families read
(:mod:`sluice.core.observability.statistics`)."""

from __future__ import annotations

import socket

from sluice.core.observability.statistics import count_field, ns_field
from sluice.core.torchserve.versions import record_of
from sluice.gateway.metrics.host import escape_label, family
from sluice.gateway.metrics.snapshot import Snapshot, VersionState

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
    """The three families, each model version's labels made once for all three. A
    version's ``model_version`` is TorchServe's name for it (``1.0``, ``v2``: what its
    description shows and ``/predictions/{model}/{version}`` names), not Sluice's folder
    number. TorchServe labels a request by the version it named (``default`` when it named
    none); Sluice's counters are kept per version served, so every request counts under the
    version that answered it. With model namespacing, a model is named as its clients name
    it (a copy of a name several repositories hold by that name, not Sluice's internal
    one) and every series is labelled by its ``namespace`` too, as Triton's families are,
    which keeps the copies apart."""
    host = escape_label(hostname or socket.gethostname())
    namespaced = any(state.namespace for state in snapshot.versions)
    labelled = [
        (
            f'model_name="{escape_label(state.listed_as or state.model)}",'
            + (f'namespace="{escape_label(state.namespace)}",' if namespaced else "")
            + f'model_version="{escape_label(_shown(state))}",hostname="{host}"',
            state.counters,
        )
        for state in snapshot.versions
    ]
    lines: list[str] = []
    for name, help_text, field in _FAMILIES:
        family(lines, name, help_text, "counter")
        for labels, counters in labelled:
            if field is None:
                value = counters.get(count_field("success"), 0) + counters.get(
                    count_field("fail"), 0
                )
            else:
                value = counters.get(field, 0) // 1000
            lines.append(f"{name}{{{labels}}} {value}")
    return lines


def _shown(state: VersionState) -> str:
    """TorchServe's name for the version (one laid out by hand has none: ``<number>.0``)."""
    return state.torchserve_version or record_of({}, state.version).version
