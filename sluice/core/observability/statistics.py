"""Triton's statistics extension: the counters workers keep and how they read.

Workers add to per-model-version Redis hashes after each batch; gateways read
them back and render Triton's ``/v2/models/{m}/stats`` JSON. Both sides use
the field names defined here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

DURATION_KINDS = ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output")
BATCH_KINDS = ("compute_input", "compute_infer", "compute_output")
INFERENCE_COUNT = "inference_count"
EXECUTION_COUNT = "execution_count"
LAST_INFERENCE = "last_inference"


RECORD_SCRIPT = """
local position = 1
for k = 1, #KEYS do
    local pairs = tonumber(ARGV[position])
    for i = 1, pairs do
        redis.call('HINCRBY', KEYS[k], ARGV[position + 2 * i - 1], ARGV[position + 2 * i])
    end
    position = position + 2 * pairs + 1
end
if ARGV[position] then
    redis.call('HSET', KEYS[1], 'last_inference', ARGV[position])
end
return 0
"""
"""Adds counters to several hashes in one command: ``KEYS`` are the hashes; ``ARGV`` holds,
per hash, the number of (field, increment) pairs followed by the pairs, and finally an
optional ``last_inference`` value for the first hash. One command per batch keeps the
worker's publish round trip small."""


def record_arguments(
    increments: list[dict[str, int]], last_inference_ms: int | None
) -> list[str | int]:
    """``ARGV`` for :data:`RECORD_SCRIPT`, one increments dict per key."""
    arguments: list[str | int] = []
    for fields in increments:
        arguments.append(len(fields))
        for name, value in fields.items():
            arguments += [name, value]
    if last_inference_ms is not None:
        arguments.append(last_inference_ms)
    return arguments


FAILURE_REASONS = ("REJECTED", "CANCELED", "BACKEND", "OTHER")
"""Triton's ``reason`` label of ``nv_inference_request_failure``."""

_REASON_BY_ERROR = {
    "DeadlineExceeded": "REJECTED",  # Triton: a request that timed out in the queue
    "Overloaded": "REJECTED",  # the queue is full
    "ServerBusy": "REJECTED",
    "InferenceFailed": "BACKEND",
    "Cancelled": "CANCELED",
}


def failure_reason(error_kind: str) -> str:
    """Triton's failure reason for an error (by its name, as it travels between processes)."""
    return _REASON_BY_ERROR.get(error_kind, "OTHER")


def failure_field(reason: str) -> str:
    """The counter of failed requests for one of :data:`FAILURE_REASONS`."""
    return f"fail.{reason}.count"


DEADLINE_MISS_STAGES = ("queue", "gateway")
"""Where a request's deadline passed: in the queue (the worker refused it before computing)
or at the gateway (no answer in time)."""

RECLAIMED = "reclaimed.count"
"""Entries a worker took over from a dead or stuck one."""
DEAD_LETTERED = "dead_letter.count"
"""Entries moved to the dead-letter stream."""

ADMISSION_REJECT_REASONS = ("queue_full", "in_flight")
"""Why a gateway refused a request before queueing it: the model's ``max_queue_size``, or
the gateway's own ``SLUICE_MAX_IN_FLIGHT``."""


_ROLLOUT_PREFIX, _COUNT_SUFFIX = "rollout.", ".count"


BATCH_ROWS = "sluice.batch.rows"
"""Rows of batch jobs answered by this model version (``sluice_batch_rows_total``)."""
BATCH_SHARD_RETRIES = "sluice.batch.shard_retries"
"""Shard attempts after the first (``sluice_batch_shard_retries_total``)."""

JOB_OUTCOMES = ("submitted", "completed", "failed", "expired", "cancelled")
"""What ``sluice_jobs_total`` counts per model version (the job scripts of
:mod:`sluice.core.jobs` add to ``job.<outcome>``)."""


def job_field(outcome: str) -> str:
    return f"job.{outcome}"


def rollout_decision_field(decision: str) -> str:
    """Counter of a rollout decision, in the candidate version's statistics hash."""
    return f"{_ROLLOUT_PREFIX}{decision}{_COUNT_SUFFIX}"


def rollout_decision(field: str) -> str | None:
    """The decision a statistics field counts, when it is a rollout decision's."""
    if field.startswith(_ROLLOUT_PREFIX) and field.endswith(_COUNT_SUFFIX):
        return field[len(_ROLLOUT_PREFIX) : -len(_COUNT_SUFFIX)]
    return None


def deadline_miss_field(stage: str) -> str:
    return f"deadline_miss.{stage}.count"


BATCH_CLOSE_REASONS = ("full", "preferred", "window", "adaptive", "stopping")
"""Why a worker closed a batch (``sluice_batch_closes_total``): it reached
``max_batch_size`` or a preferred size, the queue delay ran out, waiting no longer paid
(adaptive batching, :mod:`sluice.workers.adaptive`), or the worker was stopping."""


def batch_close_field(reason: str) -> str:
    return f"batch_close.{reason}.count"


def reject_field(reason: str) -> str:
    return f"reject.{reason}.count"


def count_field(kind: str) -> str:
    return f"{kind}.count"


def ns_field(kind: str) -> str:
    return f"{kind}.ns"


def batch_field(batch_size: int, kind: str, unit: str) -> str:
    return f"{batch_size}:{kind}.{unit}"


RESPONSE_OUTCOMES = ("success", "fail", "empty_response", "cancel")
"""How a decoupled model's response ended, in Triton's ``response_stats``."""
RESPONSE_KINDS = ("compute_infer", "compute_output", *RESPONSE_OUTCOMES)
MAX_RESPONSE_INDEX = 4095
"""Responses of a request past this index are not counted in ``response_stats`` (Triton
counts every index; a statistics hash must stay bounded)."""
_RESPONSE_PREFIX = "response."


def response_field(index: int, kind: str, unit: str) -> str:
    """The counter of response ``index``'s ``kind`` (of :data:`RESPONSE_KINDS`)."""
    return f"{_RESPONSE_PREFIX}{index}.{kind}.{unit}"


def _response_stats(counters: Mapping[bytes, bytes]) -> dict[str, dict[str, dict[str, int]]]:
    """Triton's ``response_stats``: response index (a string) -> each kind's count and ns."""
    found: dict[int, dict[str, dict[str, int]]] = {}
    prefix = _RESPONSE_PREFIX.encode()
    for name, value in counters.items():
        if not name.startswith(prefix):
            continue
        index, _, rest = name[len(prefix) :].decode(errors="replace").partition(".")
        kind, _, unit = rest.rpartition(".")
        if not index.isdigit() or kind not in RESPONSE_KINDS or unit not in ("count", "ns"):
            continue
        kinds = found.setdefault(int(index), {k: {"count": 0, "ns": 0} for k in RESPONSE_KINDS})
        kinds[kind][unit] = _count(value)
    return {str(index): found[index] for index in sorted(found)}


def _count(raw: bytes | None) -> int:
    """A counter's value; 0 for what is not one (a malformed value fails no answer)."""
    try:
        return int(raw) if raw is not None else 0
    except ValueError:
        return 0


def _int(values: Mapping[bytes, bytes], name: str) -> int:
    return _count(values.get(name.encode()))


def _duration(values: Mapping[bytes, bytes], kind: str) -> dict[str, int]:
    return {"count": _int(values, count_field(kind)), "ns": _int(values, ns_field(kind))}


def render_model_stats(
    model: str,
    version: int,
    counters: Mapping[bytes, bytes],
    batch_counters: Mapping[bytes, bytes],
    instance_counters: Mapping[bytes, bytes],
) -> dict[str, Any]:
    """One ``model_stats`` item in Triton's layout (plus Sluice's per-instance counts)."""
    inference_stats = {kind: _duration(counters, kind) for kind in DURATION_KINDS}
    inference_stats["cache_hit"] = _duration(counters, "cache_hit")
    inference_stats["cache_miss"] = _duration(counters, "cache_miss")
    sizes = sorted(
        {int(size) for size, _, _ in (f.partition(b":") for f in batch_counters) if size.isdigit()}
    )
    batch_stats = [
        {
            "batch_size": size,
            **{
                kind: {
                    "count": _int(batch_counters, batch_field(size, kind, "count")),
                    "ns": _int(batch_counters, batch_field(size, kind, "ns")),
                }
                for kind in BATCH_KINDS
            },
        }
        for size in sizes
    ]
    return {
        "name": model,
        "version": str(version),
        "last_inference": _int(counters, LAST_INFERENCE),
        "inference_count": _int(counters, INFERENCE_COUNT),
        "execution_count": _int(counters, EXECUTION_COUNT),
        "inference_stats": inference_stats,
        "response_stats": _response_stats(counters),
        "batch_stats": batch_stats,
        "memory_usage": [],
        "instance_stats": [
            {"instance": key.decode(errors="replace"), "execution_count": _count(value)}
            for key, value in sorted(instance_counters.items())
        ],
    }
