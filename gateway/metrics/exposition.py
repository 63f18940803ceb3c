"""``GET /metrics``: Triton's metric families, then Sluice's, in Prometheus' text format.

Where the numbers come from: every worker adds to its model version's statistics hash in
Redis after each batch (:mod:`sluice.core.observability.statistics`, the same counters as
Triton's statistics extension, plus the histograms of
:mod:`sluice.core.observability.histograms`), and each gateway adds its refusals and
deadline misses, and reports its gauges, every catalog refresh
(:mod:`sluice.gateway.control.gateway_report`). A scrape reads all of it from Redis
(:mod:`sluice.gateway.metrics.snapshot`). So whichever gateway process answers, the numbers
are the same, cover workers on every host, and do not go back when a worker restarts (they
live in Redis, not in the process that died), with no prometheus-client multiprocess
directory to keep clean. CPU, memory and GPUs are this host's.

Triton's families are written here rather than by prometheus-client, whose exposition
renames a counter ``X`` to ``X_total``: Triton's counters have no suffix, and dashboards
and alerts written for Triton must find them under the same names. Sluice's own families
(:mod:`sluice.gateway.metrics.sluice_families`) follow Prometheus' conventions and use
prometheus-client.
"""

from __future__ import annotations

import asyncio
import logging

from sluice.core.observability import custom_metrics
from sluice.core.observability.statistics import (
    EXECUTION_COUNT,
    FAILURE_REASONS,
    INFERENCE_COUNT,
    count_field,
    failure_field,
    ns_field,
)
from sluice.core.settings import GatewaySettings
from sluice.core.shm import segment_bytes
from sluice.core.tenant_limits import TenantLimits
from sluice.gateway.metrics import gpu, sluice_families
from sluice.gateway.metrics.host import HOST, escape_label, family
from sluice.gateway.metrics.snapshot import Snapshot, VersionState
from sluice.gateway.metrics.torchserve_families import torchserve_lines
from sluice.gateway.state import GatewayState
from sluice.gateway.tenants import metrics as tenant_metrics

log = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_COUNTERS: tuple[tuple[str, str, str, int], ...] = (
    # name, help, field in the statistics hash, divisor (ns -> us)
    (
        "nv_inference_request_success",
        "Number of successful inference requests, all batch sizes",
        count_field("success"),
        1,
    ),
    (
        "nv_inference_count",
        "Number of inferences performed (does not include cached requests)",
        INFERENCE_COUNT,
        1,
    ),
    (
        "nv_inference_exec_count",
        "Number of model executions performed (does not include cached requests)",
        EXECUTION_COUNT,
        1,
    ),
    (
        "nv_inference_request_duration_us",
        "Cumulative inference request duration in microseconds (includes cached requests)",
        ns_field("success"),
        1000,
    ),
    (
        "nv_inference_queue_duration_us",
        "Cumulative inference queuing duration in microseconds (includes cached requests)",
        ns_field("queue"),
        1000,
    ),
    (
        "nv_inference_compute_input_duration_us",
        "Cumulative compute input duration in microseconds (does not include cached requests)",
        ns_field("compute_input"),
        1000,
    ),
    (
        "nv_inference_compute_infer_duration_us",
        "Cumulative compute inference duration in microseconds (does not include cached requests)",
        ns_field("compute_infer"),
        1000,
    ),
    (
        "nv_inference_compute_output_duration_us",
        "Cumulative inference compute output duration in microseconds (does not include "
        "cached requests)",
        ns_field("compute_output"),
        1000,
    ),
)
_CACHE_COUNTERS: tuple[tuple[str, str, str, int], ...] = (
    (
        "nv_cache_num_hits_per_model",
        "Number of cache hits per model",
        count_field("cache_hit"),
        1,
    ),
    (
        "nv_cache_num_misses_per_model",
        "Number of cache misses per model",
        count_field("cache_miss"),
        1,
    ),
    (
        "nv_cache_hit_duration_per_model",
        "Total cache hit duration per model, in microseconds",
        ns_field("cache_hit"),
        1000,
    ),
    (
        "nv_cache_miss_duration_per_model",
        "Total cache miss (insert + lookup) duration per model, in microseconds",
        ns_field("cache_miss"),
        1000,
    ),
)
"""Triton's response cache families, written where the deployment has a cache (as Triton
writes them only with ``--cache-config``)."""
_FAILURE = (
    "nv_inference_request_failure",
    "Number of failed inference requests, all batch sizes",
)
_PENDING = (
    "nv_inference_pending_request_count",
    "Instantaneous number of pending requests awaiting execution per-model.",
)


async def metrics_text(state: GatewayState) -> bytes:
    """The whole ``/metrics`` text (callers check ``allow_metrics``).

    Scrapes that arrive while one is being taken get its text: however many clients
    scrape at once (without API keys, nobody needs one to scrape), a process reads Redis
    and renders for one of them at a time. The scrape goes on if the client that started
    it leaves."""
    running = state.scrape
    if running is None or running.done():
        running = state.scrape = asyncio.create_task(_scrape(state))
    return await asyncio.shield(running)


async def _scrape(state: GatewayState) -> bytes:
    snapshot = await state.control.metric_snapshot(state.view)
    # Rendering takes milliseconds per hundred series: not on the event loop.
    quota = state.quota
    return await asyncio.to_thread(
        _text, snapshot, state.settings, quota.limits, tuple(quota.tenants)
    )


def _text(
    snapshot: Snapshot, settings: GatewaySettings, limits: TenantLimits, tenants: tuple[str, ...]
) -> bytes:
    segments = segment_bytes(settings.namespace) if settings.shm_same_host else None
    lines = triton_lines(snapshot, cache=settings.response_cache_bytes > 0)
    if settings.torchserve_metrics:
        lines += torchserve_lines(snapshot)
    lines += HOST.lines()
    lines += gpu.GPUS.lines()
    lines += custom_metrics.render(custom_metrics.decode_reports(snapshot.custom.values()))
    text = ("\n".join(lines) + "\n").encode()
    return (
        text
        + sluice_families.render(snapshot, segments, tenants)
        + tenant_metrics.render(snapshot, limits, tenants)
    )


def triton_lines(snapshot: Snapshot, *, cache: bool = False) -> list[str]:
    """Triton's per-model families for every served model version (``cache``: the response
    cache's too)."""
    versions = [(state, _model_labels(state)) for state in snapshot.versions]
    lines: list[str] = []
    for name, help_text, field_name, divisor in _COUNTERS + (_CACHE_COUNTERS if cache else ()):
        family(lines, name, help_text, "counter")
        for state, labels in versions:
            value = state.counters.get(field_name, 0) // divisor
            lines.append(_sample(name, labels, value))
    family(lines, *_FAILURE, "counter")
    for state, labels in versions:
        for reason in FAILURE_REASONS:
            count = state.counters.get(failure_field(reason), 0)
            lines.append(_sample(_FAILURE[0], labels, count, reason=reason))
    family(lines, *_PENDING, "gauge")
    for state, labels in versions:
        waiting = sum(stream.waiting for stream in state.streams)
        lines.append(_sample(_PENDING[0], labels, waiting))
    return lines


def _model_labels(state: VersionState) -> str:
    """A model version's labels, ``model`` and ``version``. With model namespacing, as
    Triton's metric reporter labels every model: by its repository too, ``namespace``; a
    copy of a name several repositories hold by that name (never by Sluice's internal name
    for it), its series and the other copies' kept apart by their namespaces."""
    model = escape_label(state.listed_as or state.model)
    if state.namespace:
        namespace = escape_label(state.namespace)
        return f'model="{model}",namespace="{namespace}",version="{state.version}"'
    return f'model="{model}",version="{state.version}"'


def _sample(name: str, labels: str, value: float, reason: str = "") -> str:
    if reason:
        labels = f'{labels},reason="{reason}"'
    return f"{name}{{{labels}}} {value}"
