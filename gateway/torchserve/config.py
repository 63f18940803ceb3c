"""Changes TorchServe's management API makes to a served model's configuration (its JSON
form, :func:`sluice.core.config.config_to_json`): the versions served, the workers, the
batching. Everything else in the configuration stays as it is.

Workers follow :mod:`sluice.core.torchserve.config`: ``min`` instances start (at least one), and
the controller's autoscaling keeps them between ``min`` and ``max`` when ``max`` is above
them or ``min`` is 0.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sluice.core.config import ModelConfig
from sluice.core.torchserve.config import MAX_INSTANCES, MIN_INSTANCES
from sluice.core.torchserve.versions import VersionRecord, without_version

Json = dict[str, Any]


def _parameters(config: Json) -> dict[str, Any]:
    return dict(config.get("parameters") or {})


def with_versions(
    config: Json, versions: list[int], added: Mapping[int, VersionRecord], removed: int | None
) -> Json:
    """``config`` serving exactly ``versions``, with the records of those ``added`` and
    without the record of the one ``removed``."""
    changed = dict(config)
    changed["version_policy"] = {"specific": {"versions": sorted(versions)}}
    parameters = _parameters(config)
    if removed is not None:
        flat = {key: value.get("string_value", "") for key, value in parameters.items()}
        kept = without_version(flat, removed)
        parameters = {key: value for key, value in parameters.items() if key in kept}
    for number, record in added.items():
        for key, value in record.parameters(number).items():
            parameters[key] = {"string_value": value}
    changed["parameters"] = parameters
    return changed


def with_workers(config: Json, minimum: int, maximum: int) -> Json:
    """``config`` with ``minimum`` .. ``maximum`` workers (``maximum`` >= ``minimum``)."""
    changed = dict(config)
    count = max(1, minimum)
    groups = [dict(group) for group in config.get("instance_group") or [{}]]
    groups = [{**groups[0], "count": count}]  # TorchServe's workers are one group
    changed["instance_group"] = groups
    parameters = _parameters(config)
    if minimum == 0 or maximum > count:
        parameters[MIN_INSTANCES] = {"string_value": str(minimum)}
        parameters[MAX_INSTANCES] = {"string_value": str(max(maximum, count))}
    else:
        parameters.pop(MIN_INSTANCES, None)
        parameters.pop(MAX_INSTANCES, None)
    changed["parameters"] = parameters
    return changed


def with_batching(
    config: Json,
    batch_size: int | None = None,
    max_batch_delay_ms: int | None = None,
    response_timeout_s: int | None = None,
) -> Json:
    """``config`` with the batching a registration names (None: as it is)."""
    if batch_size is None and max_batch_delay_ms is None and response_timeout_s is None:
        return config
    changed = dict(config)
    dynamic = dict(config.get("dynamic_batching") or {})
    if batch_size is not None:
        changed["max_batch_size"] = batch_size
    if max_batch_delay_ms is not None:
        dynamic["max_queue_delay_microseconds"] = max_batch_delay_ms * 1000
    if response_timeout_s is not None:
        policy = dict(dynamic.get("default_queue_policy") or {})
        policy["default_timeout_microseconds"] = response_timeout_s * 1_000_000
        dynamic["default_queue_policy"] = policy
    changed["dynamic_batching"] = dynamic
    return changed


def workers_of(config: ModelConfig) -> tuple[int, int]:
    """The model's (minimum, maximum) workers."""
    count = config.total_instances
    parameters = config.parameters
    try:
        return int(parameters.get(MIN_INSTANCES, count)), int(parameters.get(MAX_INSTANCES, count))
    except ValueError:
        return count, count
