"""A load that changes only a model's instances updates the model instead of reloading it.

Triton updates a loaded model in place when a load (or, in poll mode, a change of
``config.pbtxt``) changes nothing but its instance groups: instances are added or removed
and the others go on serving, warm. So does ``sluice up``: the workers whose place (version,
instance index, kind and GPU) the new configuration still has keep serving, only the missing
ones start, and those beyond the new count are retired (each answers what it holds first).
A TorchServe ``PUT /models/{m}?min_worker=N`` is such a load too, its autoscaling bounds
(``sluice.min_instances``, ``sluice.max_instances``) the only other change allowed.

Anything else (other configuration, files added, removed or modified since the model was
loaded, by their sizes and modification times as Triton judges them, other versions) is a
reload. So is a sequence model's: its sequences are tied to their instances, and Triton too
waits for them before it removes one.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from sluice.core.config import CONFIG_FILENAME, ModelConfig
from sluice.core.repository import CUSTOM_CONFIGS, RepositoryModel
from sluice.core.torchserve.config import MAX_INSTANCES, MIN_INSTANCES
from sluice.scheduler.executor.supervisor import Child, ChildSpec

Fingerprint = frozenset[tuple[str, int, int]]
"""A model directory's files but its configurations (``config.pbtxt``, ``configs/*.pbtxt``):
(relative path, size, mtime in ns)."""

_INSTANCE_PARAMETERS = frozenset((MIN_INSTANCES, MAX_INSTANCES))


def fingerprint(model_dir: Path) -> Fingerprint:
    """What a load reads of ``model_dir`` apart from its configuration (links followed, as a
    staged copy links the repository's files)."""
    found: set[tuple[str, int, int]] = set()
    for root, _dirs, files in os.walk(model_dir, followlinks=True):
        for name in files:
            path = Path(root, name)
            relative = path.relative_to(model_dir).as_posix()
            if relative == CONFIG_FILENAME or _is_custom_config(relative):
                continue
            try:
                stat = path.stat()
            except OSError:  # (a dangling link: a change all the same)
                found.add((relative, -1, -1))
                continue
            found.add((relative, stat.st_size, stat.st_mtime_ns))
    return frozenset(found)


def _is_custom_config(relative: str) -> bool:
    folder, _, name = relative.partition("/")
    return folder == CUSTOM_CONFIGS and "/" not in name and name.endswith(".pbtxt")


def instances_only(old: RepositoryModel, new: RepositoryModel) -> bool:
    """Whether ``new`` differs from ``old`` in its instances at most (its files compared
    apart, by :func:`fingerprint`)."""
    if old.config is None or new.config is None or old.versions != new.versions:
        return False
    if old.config.sequence_batching is not None or new.config.sequence_batching is not None:
        return False
    return _without_instances(old.config) == _without_instances(new.config)


def _without_instances(config: ModelConfig) -> ModelConfig:
    parameters = {k: v for k, v in config.parameters.items() if k not in _INSTANCE_PARAMETERS}
    return replace(config, instance_groups=(), parameters=parameters)


def plan(
    running: Sequence[Child], specs: Sequence[ChildSpec]
) -> tuple[list[Child], list[ChildSpec]]:
    """The running workers that keep their place in the new configuration, and the specs of
    the workers to start for the places none holds (the others are to be retired)."""
    free = [child for child in running if not child.retiring]
    kept: list[Child] = []
    starting: list[ChildSpec] = []
    for spec in specs:
        place = _place(spec)
        holder = next((child for child in free if _place(child.spec) == place), None)
        if holder is None:
            starting.append(spec)
        else:
            free.remove(holder)
            kept.append(holder)
    return kept, starting


def _place(spec: ChildSpec) -> tuple[int | None, str | None, str | None, str | None]:
    """A worker's place: its version, instance index (``--slot``), kind and GPU."""
    return (
        spec.version,
        _option(spec.argv, "--slot"),
        _option(spec.argv, "--kind"),
        _option(spec.argv, "--gpu"),
    )


def _option(argv: Sequence[str], name: str) -> str | None:
    for index, value in enumerate(argv[:-1]):
        if value == name:
            return argv[index + 1]
    return None
