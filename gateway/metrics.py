"""``GET /metrics``: Triton's metric families in Prometheus' text format.

Where the numbers come from: every worker adds to its model version's statistics hash in
Redis after each batch (:mod:`sluice.statistics`, the same counters as Triton's statistics
extension), and each gateway adds the requests its admission control refused, every
catalog refresh. A scrape reads those hashes in one pipeline. So whichever gateway
process answers, the numbers are the same, cover workers on every host, and do not go
back when a worker restarts (they live in Redis, not in the process that died), with no
prometheus-client multiprocess directory to keep clean. The pending-request gauge is the
queue depth the gateway already follows; CPU and memory are this host's, from /proc.

The text is written here rather than by prometheus-client, whose exposition renames a
counter ``X`` to ``X_total``: Triton's counters have no suffix, and dashboards and alerts
written for Triton must find them under the same names.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from redis.asyncio import Redis

from gateway.admission import Admission
from sluice.keys import Keys
from sluice.statistics import (
    EXECUTION_COUNT,
    FAILURE_REASONS,
    INFERENCE_COUNT,
    count_field,
    failure_field,
    ns_field,
)

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
_FAILURE = (
    "nv_inference_request_failure",
    "Number of failed inference requests, all batch sizes",
)
_PENDING = (
    "nv_inference_pending_request_count",
    "Instantaneous number of pending requests awaiting execution per-model.",
)

ModelVersion = tuple[str, int]


async def flush_rejections(redis: Redis, keys: Keys, admission: Admission) -> None:
    """Add this gateway's admission refusals to the shared counters (REJECTED); kept for
    the next try when Redis cannot take them."""
    rejected = admission.take_rejected()
    if not rejected:
        return
    try:
        async with redis.pipeline(transaction=False) as pipe:
            for (model, version), count in rejected.items():
                pipe.hincrby(keys.stats(model, version), failure_field("REJECTED"), count)
            await pipe.execute()
    except BaseException:
        admission.rejected.update(rejected)
        raise


async def render(
    redis: Redis, keys: Keys, models: list[ModelVersion], pending: dict[ModelVersion, int]
) -> bytes:
    """The metrics text for ``models`` (model name, version)."""
    async with redis.pipeline(transaction=False) as pipe:
        for model, version in models:
            pipe.hgetall(keys.stats(model, version))
        hashes: list[dict[bytes, bytes]] = await pipe.execute()
    counters = [{k.decode(): int(v) for k, v in values.items()} for values in hashes]
    lines: list[str] = []
    for name, help_text, field_name, divisor in _COUNTERS:
        _family(lines, name, help_text, "counter")
        for (model, version), values in zip(models, counters, strict=True):
            lines.append(_sample(name, model, version, values.get(field_name, 0) // divisor))
    _family(lines, *_FAILURE, "counter")
    for (model, version), values in zip(models, counters, strict=True):
        for reason in FAILURE_REASONS:
            count = values.get(failure_field(reason), 0)
            lines.append(_sample(_FAILURE[0], model, version, count, reason=reason))
    _family(lines, *_PENDING, "gauge")
    for model, version in models:
        lines.append(_sample(_PENDING[0], model, version, pending.get((model, version), 0)))
    lines += HOST.lines()
    return ("\n".join(lines) + "\n").encode()


def _family(lines: list[str], name: str, help_text: str, kind: str) -> None:
    lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]


def _sample(name: str, model: str, version: int, value: float, reason: str = "") -> str:
    labels = f'model="{_escape(model)}",version="{version}"'
    if reason:
        labels = f'{labels},reason="{reason}"'
    return f"{name}{{{labels}}} {value}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


@dataclass
class HostUsage:
    """Triton's ``nv_cpu_*`` gauges for this host, from /proc (Linux)."""

    proc: Path = Path("/proc")
    _last: tuple[int, int] | None = field(default=None, init=False)

    def lines(self) -> list[str]:
        lines: list[str] = []
        utilization = self._cpu_utilization()
        if utilization is not None:
            _family(lines, "nv_cpu_utilization", "CPU utilization rate [0.0 - 1.0]", "gauge")
            lines.append(f"nv_cpu_utilization {utilization:.6f}")
        memory = self._memory()
        if memory is not None:
            total, used = memory
            _family(lines, "nv_cpu_memory_total_bytes", "CPU total memory (RAM), in bytes", "gauge")
            lines.append(f"nv_cpu_memory_total_bytes {total}")
            _family(lines, "nv_cpu_memory_used_bytes", "CPU used memory (RAM), in bytes", "gauge")
            lines.append(f"nv_cpu_memory_used_bytes {used}")
        return lines

    def _cpu_utilization(self) -> float | None:
        """Busy share of all CPUs since the previous scrape (since boot at the first)."""
        try:
            fields = (self.proc / "stat").read_text().split("\n", 1)[0].split()[1:]
        except OSError:
            return None
        ticks = [int(value) for value in fields]
        idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle + iowait
        total = sum(ticks[:8])
        last_idle, last_total = self._last or (0, 0)
        self._last = (idle, total)
        elapsed = total - last_total
        return 0.0 if elapsed <= 0 else max(0.0, min(1.0, 1 - (idle - last_idle) / elapsed))

    def _memory(self) -> tuple[int, int] | None:
        try:
            info = dict(
                _meminfo_line(line) for line in (self.proc / "meminfo").read_text().splitlines()
            )
        except (OSError, ValueError):
            return None
        total, available = info.get("MemTotal"), info.get("MemAvailable")
        if total is None or available is None:
            return None
        return total, total - available


def _meminfo_line(line: str) -> tuple[str, int]:
    name, _, rest = line.partition(":")
    parts = rest.split()
    return name, int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)


HOST = HostUsage()


def served(entries: Iterable[tuple[str, list[int]]]) -> list[ModelVersion]:
    """(model, version) for every version served, sorted."""
    return sorted((name, version) for name, versions in entries for version in versions)
