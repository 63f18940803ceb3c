"""What ``sluice up`` loads at start with explicit model control.

The models named by ``--load-model`` (``*``: all), and:

- joining executors already serving (other hosts): what the catalog says they have loaded,
  each as they loaded it (:mod:`sluice.scheduler.executor.loaded_as`), so that this host
  serves the same models instead of publishing a catalog without them;
- alone, with a snapshot folder (``SLUICE_SNAPSHOT_DIR``): what its last snapshot says it
  had loaded, as it loaded it (:mod:`sluice.scheduler.executor.snapshot`), whose records
  then go to Redis for the executors that join later;
- alone without one: nothing more, as Triton starts afresh.

Alone, it first clears the load records in Redis: those of earlier executors (a Redis that
outlived them keeps them) would make a host that joins later load their configurations.

An ensemble brings the models it calls, as Triton loads them with it.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from redis import Redis
from redis.exceptions import RedisError

from sluice.core.catalog import CatalogEntry, decode_entry
from sluice.core.control import ControlCommand, live_executors
from sluice.core.errors import StartupFailed
from sluice.core.keys import Keys
from sluice.core.repository import RepositoryModel, composing_models
from sluice.core.settings import UpSettings
from sluice.core.wire import MalformedEntry
from sluice.scheduler.executor.loaded_as import (
    forget_all_loads,
    recorded_loads,
    remember_load,
    staged_loads,
)
from sluice.scheduler.executor.snapshot import Snapshots

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StartLoads:
    client: Redis
    keys: Keys
    settings: UpSettings
    repository: Path
    staging: Path

    def choose(
        self, models: list[RepositoryModel], snapshots: Snapshots | None
    ) -> list[RepositoryModel]:
        """The models to load now (``models``: the repository's), and the snapshot written
        with them: each model as it is loaded now (joining, as the others loaded it)."""
        try:
            names, commands = self._from_others()
            if names is None:
                names, commands = self._from_snapshot(snapshots)
        except RedisError as exc:
            raise StartupFailed(f"cannot read from Redis what is loaded: {exc}") from None
        wanted = initially_loaded(self.settings.load_model, models, names)
        staged = staged_loads(
            commands,
            self.repository,
            self.staging,
            self.settings.model_config_name,
            default_max_batch_size=self.settings.default_max_batch_size,
        )
        loaded = as_loaded(wanted, staged)
        missing = sorted(names - {model.name for model in loaded})
        if missing:
            log.warning("not loading %s: not in the repository", ", ".join(missing))
        if snapshots is not None:
            try:
                snapshots.save_all((model.name for model in loaded), commands)
            except OSError as exc:
                raise StartupFailed(
                    f"SLUICE_SNAPSHOT_DIR: cannot write the model snapshot in "
                    f"{snapshots.folder}: {exc.strerror or exc}"
                ) from None
        return loaded

    def _from_others(self) -> tuple[set[str] | None, dict[str, ControlCommand]]:
        """What the live executors have loaded, and how; None when there are none."""
        entries = others_catalog(self.client, self.keys)
        if entries is None:
            return None, {}
        names = {e.name for e in entries if e.available and not e.on_demand}
        if names:
            log.info(
                "joining the executors already serving: loading what they have loaded (%s)",
                ", ".join(sorted(names)),
            )
        return names, recorded_loads(self.client, self.keys, names)

    def _from_snapshot(
        self, snapshots: Snapshots | None
    ) -> tuple[set[str], dict[str, ControlCommand]]:
        forget_all_loads(self.client, self.keys)
        restored = snapshots.restore() if snapshots is not None else None
        if restored is None:
            return set(), {}
        names, commands = restored
        if names:
            log.info("loading the models of the snapshot (%s)", ", ".join(sorted(names)))
        for command in commands.values():  # (for the executors that join later)
            remember_load(self.client, self.keys, command)
        return names, commands


def known_to_others(client: Redis, keys: Keys) -> set[str]:
    """The models the live executors' catalog lists as known though not loaded (unloaded, or
    whose load failed: :attr:`~sluice.core.catalog.CatalogEntry.once_loaded`), read before
    this executor publishes its own: one that joins them answers those models as they do.
    None alone: a start alone starts afresh, as Triton's does."""
    return {entry.name for entry in others_catalog(client, keys) or () if entry.once_loaded}


def others_catalog(client: Redis, keys: Keys) -> list[CatalogEntry] | None:
    """The catalog the live executors publish (its entries that can be read); None when no
    executor is live."""
    if not live_executors(client, keys):
        return None
    entries = []
    for value in cast(dict[bytes, bytes], client.hgetall(keys.catalog)).values():
        with contextlib.suppress(MalformedEntry):
            entries.append(decode_entry(value))
    return entries


def initially_loaded(
    load_model: Iterable[str], models: list[RepositoryModel], names: set[str]
) -> list[RepositoryModel]:
    """The repository's models named by ``load_model`` (``*``: all) or ``names``, and the
    models each of them calls if an ensemble; a name several repositories hold (model
    namespacing) names each copy."""
    wanted = set(load_model) | names
    if "*" in wanted:
        return models
    wanted |= {model.name for model in models if model.listed_as and model.listed_as in wanted}
    by_name = {model.name: model for model in models}
    for name in list(wanted):
        model = by_name.get(name)
        if model is not None and model.config is not None and model.config.is_ensemble:
            wanted.update(composing_models(model.config, by_name.get))
    return [m for m in models if m.name in wanted]


def as_loaded(
    loaded: list[RepositoryModel], staged: Mapping[str, RepositoryModel]
) -> list[RepositoryModel]:
    """``loaded``, each model that was loaded with a command of its own staged as it was
    (and those loaded from files alone, which the repository lacks)."""
    names = {model.name for model in loaded}
    return [staged.get(m.name, m) for m in loaded] + [
        model for name, model in sorted(staged.items()) if name not in names
    ]
