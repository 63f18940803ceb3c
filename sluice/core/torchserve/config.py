"""The configuration (config.pbtxt) Sluice serves a TorchServe archive with, from
TorchServe's settings of the model.

Batching: ``batchSize`` becomes ``max_batch_size`` and ``maxBatchDelay`` (milliseconds) the
dynamic batcher's window. Workers: ``minWorkers`` instances start (at least one: a model
without a worker would answer nothing); when ``maxWorkers`` is above them, or
``minWorkers`` is 0, the controller's autoscaling keeps the instances between the two
(``sluice.min_instances`` / ``sluice.max_instances``; from 0, a model starts on demand and
stops when idle). ``deviceType`` gpu makes the instances ``KIND_GPU``. The queue's bound and
the requests' deadline are ``job_queue_size`` and ``responseTimeout`` (0: the server's
defaults). Versions: each one served is listed (``version_policy: specific``) with what it
is to TorchServe's API (:mod:`sluice.core.torchserve.versions`). The tensors are those of the
``torchserve`` backend (:mod:`sluice.workers.backends.torchserve_backend`).
"""

from __future__ import annotations

from collections.abc import Mapping

from sluice.core.errors import InvalidConfig
from sluice.core.torchserve.versions import VersionRecord

MIN_INSTANCES, MAX_INSTANCES = "sluice.min_instances", "sluice.max_instances"
"""The autoscaling parameters (scheduler/controller/autoscaling.py)."""
MAX_WORKERS = 256
"""The most instances autoscaling keeps (its own bound)."""


def check_model_name(name: str, where: str) -> None:
    """A model name that can be a folder of the repository (and a TorchServe name): not
    ``.``, ``..`` nor a hidden folder, which the repository's scan passes over."""
    if (
        not name.replace("-", "_").replace(".", "_").isidentifier()
        or name.startswith(".")
        or len(name) > 128
    ):
        raise InvalidConfig(f"{where}: model name {name!r} cannot be a folder name")


def triton_config(
    name: str,
    batch_size: int = 1,
    max_batch_delay_ms: int = 100,
    *,
    workers: int = 1,
    max_workers: int | None = None,
    queue_size: int = 0,
    response_timeout_s: int = 0,
    gpu: bool = False,
    versions: Mapping[int, VersionRecord] | None = None,
) -> str:
    """config.pbtxt for a model served from ``<name>/<version>/model.mar`` (``versions``:
    the numbers served, with their records; None: whatever version folders there are)."""
    for value, what, least in (
        (batch_size, "batchSize", 1),
        (workers, "minWorkers", 0),
        (max_batch_delay_ms, "maxBatchDelay", 0),
        (queue_size, "job_queue_size", 0),
        (response_timeout_s, "responseTimeout", 0),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise InvalidConfig(
                f"model '{name}': {what} must be a whole number of at least {least}"
            )
    count = max(1, workers)
    ceiling = count if max_workers is None else max_workers
    if not count <= ceiling <= MAX_WORKERS or isinstance(ceiling, bool):
        raise InvalidConfig(
            f"model '{name}': maxWorkers must be a whole number from minWorkers (at least 1) "
            f"to {MAX_WORKERS}, got {max_workers}"
        )
    tensor = '{{ name: "{}" data_type: TYPE_STRING dims: [ 1 ] }}'
    policy = ""
    if queue_size or response_timeout_s:
        policy = (
            f"  default_queue_policy {{ max_queue_size: {queue_size} "
            f"default_timeout_microseconds: {response_timeout_s * 1_000_000} }}\n"
        )
    parameters: dict[str, str] = {}
    if workers == 0 or ceiling > count:
        parameters |= {MIN_INSTANCES: str(workers), MAX_INSTANCES: str(ceiling)}
    versions_text = ""
    if versions:
        listed = ", ".join(str(number) for number in sorted(versions))
        versions_text = f"version_policy {{ specific {{ versions: [ {listed} ] }} }}\n"
        for number, record in sorted(versions.items()):
            parameters |= record.parameters(number)
    kind = "KIND_GPU" if gpu else "KIND_CPU"
    return (
        f'name: "{name}"\nbackend: "torchserve"\nmax_batch_size: {batch_size}\n'
        f"input [ {tensor.format('body')}, {tensor.format('content_type')} ]\n"
        f"output [ {tensor.format('response')}, {tensor.format('response_type')} ]\n"
        f"instance_group [ {{ count: {count} kind: {kind} }} ]\n"
        f"dynamic_batching {{\n  max_queue_delay_microseconds: {max_batch_delay_ms * 1000}\n"
        f"{policy}}}\n"
        f"{versions_text}"
        + "".join(
            f"parameters {{ key: {_quoted(key)} value {{ string_value: {_quoted(value)} }} }}\n"
            for key, value in parameters.items()
        )
    )


def _quoted(text: str) -> str:
    """A string of the protobuf text format."""
    escaped = text.replace("\\", "\\\\").replace('"', '\\"')
    return '"' + escaped.replace("\n", "\\n").replace("\r", "\\r") + '"'
