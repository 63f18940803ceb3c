"""How each model was loaded, kept for the executors that join later.

With explicit model control, every executor of the deployment (one per host) carries out
each load. A load may bring its own configuration, files or versions (``POST
.../load`` with ``config`` or ``file:`` parameters, a rollout's versions); an executor that
started later used to load such a model from its own repository as it stands, so its host
served another configuration than the others. Each executor that carries out such a load
now records the command (:attr:`Keys.loaded_as`), a plain load or an unload clears it, and an
executor that joins stages the model from the record as the others did.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import cast

from redis import Redis

from sluice.core.control import ControlCommand, decode_command, encode_command
from sluice.core.errors import SluiceError
from sluice.core.keys import Keys
from sluice.core.repository import RepositoryModel, read_model
from sluice.core.repository_namespaces import link_record
from sluice.core.settings import DEFAULT_MAX_BATCH_SIZE
from sluice.scheduler.repository.staging import check_model_name, stage

log = logging.getLogger(__name__)

_FIELD = b"c"
"""The field of :func:`encode_command`'s entry that holds the command."""

RECORDED_FILES_MAX_BYTES = 8 << 20
"""The most file bytes one record keeps in Redis (for as long as the model stays loaded):
a load with more (a TorchServe archive registered through the management API) is not
recorded, and a host that joins later loads that model from its repository."""


def remember_load(
    client: Redis, keys: Keys, command: ControlCommand, *, files_of_previous: bool = False
) -> None:
    """``command`` was carried out: record it if it brought what the repository lacks.
    ``files_of_previous``: it applied to the files of the previous load (a model not in the
    repository), which the record keeps."""
    if keeps_previous_files(command, files_of_previous=files_of_previous):
        previous = _recorded(client, keys, command.model)
        command = merged(command, previous, files_of_previous=files_of_previous)
    size = sum(len(data) for data in command.files.values())
    if size > RECORDED_FILES_MAX_BYTES:
        log.warning(
            "'%s' was loaded with %d MiB of files, more than the %d MiB kept for the hosts "
            "that join later: they load it from their repository",
            command.model,
            size >> 20,
            RECORDED_FILES_MAX_BYTES >> 20,
        )
        client.hdel(keys.loaded_as, command.model)
    elif command.config is None and not command.files and not command.versions:
        client.hdel(keys.loaded_as, command.model)
    else:
        client.hset(keys.loaded_as, command.model, encode_command(command)[_FIELD])


def keeps_previous_files(command: ControlCommand, *, files_of_previous: bool) -> bool:
    """Whether ``command`` keeps the files of its model's previous load: those it adds to
    (``keep_files``), or applies to (``files_of_previous``: a new configuration of a model
    loaded from files alone)."""
    return command.keep_files or (files_of_previous and not command.files)


def merged(
    command: ControlCommand, previous: ControlCommand | None, *, files_of_previous: bool
) -> ControlCommand:
    """``command`` with the files of the ``previous`` load of its model that it keeps
    (:func:`keeps_previous_files`)."""
    if previous is None or not keeps_previous_files(command, files_of_previous=files_of_previous):
        return command
    files = {**previous.files, **command.files}
    return replace(command, files=files, keep_files=previous.keep_files)


def _recorded(client: Redis, keys: Keys, model: str) -> ControlCommand | None:
    value = cast(bytes | None, client.hget(keys.loaded_as, model))
    return decode_command({_FIELD: value}) if value is not None else None


def forget_load(client: Redis, keys: Keys, model: str) -> None:
    """``model`` was unloaded: a later load starts from the repository again."""
    client.hdel(keys.loaded_as, model)


def forget_all_loads(client: Redis, keys: Keys) -> None:
    """An executor starts alone: what earlier executors recorded is not what is loaded now
    (a Redis that outlived them keeps their records)."""
    client.delete(keys.loaded_as)


def recorded_loads(client: Redis, keys: Keys, names: Iterable[str]) -> dict[str, ControlCommand]:
    """The records of the models among ``names`` that were loaded with a command of their
    own (a malformed record is left out, with a warning)."""
    wanted = set(names)
    raw = cast(dict[bytes, bytes], client.hgetall(keys.loaded_as))
    commands: dict[str, ControlCommand] = {}
    for name_bytes, value in raw.items():
        name = name_bytes.decode(errors="replace")
        if name not in wanted:
            continue
        command = decode_command({_FIELD: value})
        if command is None or command.op != "load" or command.model != name:
            log.warning("ignoring the malformed record of how '%s' was loaded", name)
            continue
        commands[name] = command
    return commands


def staged_loads(
    commands: Mapping[str, ControlCommand],
    repository: Path,
    staging_root: Path,
    config_name: str = "",
    *,
    default_max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
) -> dict[str, RepositoryModel]:
    """Each model of ``commands`` staged as its command staged it (under ``staging_root``).
    One that cannot be staged or read again is left out, with a warning: it is then loaded
    from the repository. A name that is not one folder of the repository (it comes from
    Redis or a snapshot file) is left out too."""
    models: dict[str, RepositoryModel] = {}
    for name, command in commands.items():
        try:
            check_model_name(name)
            model_dir = stage(
                repository / name,
                staging_root / f"restored-{uuid.uuid4().hex}",
                command.config,
                command.files,
                keep=command.keep_files,
            )
            if model_dir != repository / name:
                link_record(repository, model_dir.parent)
        except (SluiceError, OSError) as exc:
            log.warning("cannot load '%s' as it was loaded before: %s", name, exc)
            continue
        model = read_model(model_dir, config_name, default_max_batch_size=default_max_batch_size)
        if model.error is not None or model.config is None:
            log.warning("cannot load '%s' as it was loaded before: %s", name, model.error)
            continue
        if command.versions:
            model = replace(model, versions=command.versions)
        models[name] = model
    return models
