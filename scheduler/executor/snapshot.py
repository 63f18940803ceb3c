"""Model snapshots: what an executor has loaded, kept on its disk for its next start.

TorchServe keeps a snapshot of its registered models and starts from the last one, so a
restart serves what was registered through the management API. With
``SLUICE_SNAPSHOT_DIR`` set, ``sluice up`` in explicit mode does the same: after every load
and unload it writes the models it has loaded (``loaded.json``) and, for each that was
loaded with a configuration, files or versions of its own, that load command
(``loads/<name in hex>.load``); when it starts while no other executor is alive, it loads
them again as they were loaded (beside its ``--load-model`` models). An executor that
joins others takes what they have loaded from Redis instead
(:mod:`sluice.scheduler.executor.loaded_as`).

Files are replaced whole (written beside and renamed), so a crash leaves the previous
snapshot; a snapshot that cannot be read is named in a warning and the executor starts
without it.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from sluice.core.control import ControlCommand, decode_command, encode_command
from sluice.scheduler.executor.loaded_as import merged

log = logging.getLogger(__name__)

INDEX = "loaded.json"
LOADS = "loads"
_FIELD = b"c"


@dataclass(frozen=True)
class Snapshots:
    folder: Path

    def save(
        self,
        loaded: Iterable[str],
        command: ControlCommand | None = None,
        *,
        files_of_previous: bool = False,
    ) -> None:
        """Record the models now loaded, and how ``command`` (just carried out) loaded its
        model: its own configuration, files or versions, or none (a plain load, an unload);
        ``files_of_previous`` as for :func:`merged`."""
        loads = self.folder / LOADS
        loads.mkdir(parents=True, exist_ok=True)
        if command is not None:
            path = loads / _file_name(command.model)
            command = merged(
                command, _read(path, command.model), files_of_previous=files_of_previous
            )
            own = command.config is not None or command.files or command.versions
            if command.op == "load" and own:
                _replace(path, encode_command(command)[_FIELD])
            else:
                path.unlink(missing_ok=True)
        index = {"models": sorted(set(loaded))}
        _replace(self.folder / INDEX, json.dumps(index).encode())

    def restore(self) -> tuple[set[str], dict[str, ControlCommand]] | None:
        """The models of the last snapshot and the load commands of those that had one; None
        where there is no snapshot, or it cannot be read (with a warning)."""
        index_path = self.folder / INDEX
        try:
            index = json.loads(index_path.read_bytes())
            names = index["models"]
            if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
                raise ValueError("'models' is not a list of model names")
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("not restoring the model snapshot %s: %s", index_path, exc)
            return None
        commands: dict[str, ControlCommand] = {}
        for name in names:
            command = _read(self.folder / LOADS / _file_name(name), name)
            if command is not None:
                commands[name] = command
        return set(names), commands


def _read(path: Path, name: str) -> ControlCommand | None:
    """The load command kept in ``path`` for model ``name``; None where there is none (it
    was loaded from the repository as it is) or it cannot be used (with a warning)."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        log.warning("cannot read how '%s' was loaded (%s): %s", name, path, exc)
        return None
    command = decode_command({_FIELD: raw})
    if command is None or command.op != "load" or command.model != name:
        log.warning("ignoring the malformed record of how '%s' was loaded", name)
        return None
    return command


def _file_name(model: str) -> str:
    """A file name for any model name (hex: no separator or dot reaches the path)."""
    return model.encode().hex() + ".load"


def _replace(path: Path, data: bytes) -> None:
    staged = path.with_name(path.name + ".new")
    staged.write_bytes(data)
    os.replace(staged, path)
