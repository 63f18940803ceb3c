"""Loading a model version into a worker: its backend, labels and batch policy, warmed up.

Runs on the worker's compute thread (a backend may bind its thread-local state there).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from sluice.core.classification import read_labels
from sluice.core.config import ModelConfig
from sluice.core.errors import InvalidConfig
from sluice.core.placement import Placement
from sluice.core.settings import DEFAULT_MAX_BATCH_SIZE
from sluice.workers.adaptive import BatchPolicy, batch_policy
from sluice.workers.backends import load_backend
from sluice.workers.backends.base import Backend
from sluice.workers.decoupled import check_streams
from sluice.workers.slots import backend_concurrency
from sluice.workers.warmup import warm_up


@dataclass
class LoadedModel:
    backend: Backend
    labels: dict[str, list[bytes]]
    """Each output's classification labels (its ``label_filename``)."""
    policy: BatchPolicy
    """When a batch closes: the config's own policy (:func:`batch_policy`), or a sequence
    model's window."""
    deadline_order: bool
    """Requests of one priority level go in deadline order (adaptive batching, unless the
    config asks Triton's ``preserve_ordering``); a sequence model's go in arrival order."""
    concurrency: int
    """Batches computed at once: the backend's ``concurrency`` (see :mod:`sluice.workers.slots`)."""


def load_model(
    config: ModelConfig,
    model_path: Path,
    placement: Placement,
    config_name: str = "",
    default_max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
) -> LoadedModel:
    """``config_name`` and ``default_max_batch_size``: how the deployment reads model
    folders (its custom configuration name, autocomplete's batch size), as an ensemble
    reads its composing models."""
    labels = read_output_labels(config, model_path.parent.parent)
    policy, deadline_order = batching_of(config)
    backend = load_backend(
        config, model_path, placement, config_name, default_max_batch_size=default_max_batch_size
    )
    try:
        check_streams(config, backend)
        concurrency = backend_concurrency(backend)
        if not config.decoupled:  # (warm-up samples expect one answer each)
            warm_up(backend, config, model_path.parent.parent)
    except BaseException:
        backend.close()
        raise
    return LoadedModel(backend, labels, policy, deadline_order, concurrency)


def batching_of(config: ModelConfig) -> tuple[BatchPolicy, bool]:
    """When a model's batches close, and whether its requests go in deadline order:
    adaptive batching orders them by deadline unless the config asks Triton's
    ``preserve_ordering``; a sequence model's go in arrival order (a sequence's requests
    must stay in order), within its strategy's window."""
    sequences = config.sequence_batching
    if sequences is not None:
        return BatchPolicy(sequences.max_queue_delay_us / 1e6, False), False
    policy = batch_policy(config)
    dynamic = config.dynamic_batching
    return policy, policy.adaptive and not (dynamic is not None and dynamic.preserve_ordering)


def read_output_labels(config: ModelConfig, model_dir: Path) -> dict[str, list[bytes]]:
    """As Triton, a ``label_filename`` that cannot be read fails the model's load."""
    labels: dict[str, list[bytes]] = {}
    for spec in config.outputs:
        if spec.label_filename:
            path = model_dir / spec.label_filename
            try:
                labels[spec.name] = read_labels(path)
            except OSError as exc:
                raise InvalidConfig(
                    f"output '{spec.name}': cannot read label_filename "
                    f"'{spec.label_filename}': {exc.strerror or exc}"
                ) from None
    return labels
