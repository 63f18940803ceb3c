"""Model snapshots: what an executor has loaded, kept on its disk for its next start.

TorchServe keeps a snapshot of its registered models and starts from the last one, so a
restart serves what was registered through the management API. With
``SLUICE_SNAPSHOT_DIR`` set, ``sluice up`` in explicit mode does the same: after every load
and unload it writes the models it has loaded (``loaded.json``) and, for each that was
loaded with a configuration, files or versions of its own, that load command
(``loads/<SHA-256 of the name>.load``, which names its model); when it starts while no
other executor is alive, it loads them again as they were loaded (beside its
``--load-model`` models). An executor that joins others takes what they have loaded from
Redis instead (:mod:`sluice.scheduler.executor.loaded_as`), and its snapshot says so.

Files are replaced whole (written to a staged file of the write's own, synced, and renamed),
so a crash leaves the previous snapshot and two executors sharing the folder do not mix
their writes; a snapshot that cannot be read (or is larger than its bound, or is not a
regular file) is named in a warning and the executor starts without it.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import stat
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from sluice.core.control import ControlCommand, decode_command, encode_command
from sluice.scheduler.executor.loaded_as import merged
from sluice.scheduler.repository.cache import sync_folder

log = logging.getLogger(__name__)

INDEX = "loaded.json"
LOADS = "loads"
_FIELD = b"c"

INDEX_MAX_BYTES = 16 << 20
"""The most bytes of ``loaded.json`` read back (tens of thousands of model names)."""

RECORD_MAX_BYTES = 1 << 30
"""The most bytes of one model's load command kept (its files: TorchServe archives of up to
256 MiB each, and the versions registered beside them): a larger one is not kept, and its
model is loaded from the repository at the next start."""


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
            _keep(path, command)
        self._write_index(loaded)

    def save_all(self, loaded: Iterable[str], commands: Mapping[str, ControlCommand]) -> None:
        """Record the models now loaded, each of ``commands`` as it was loaded and the others
        from the repository (a start: what an earlier snapshot recorded is replaced)."""
        names = set(loaded)
        loads = self.folder / LOADS
        loads.mkdir(parents=True, exist_ok=True)
        kept = {_file_name(name): c for name, c in commands.items() if name in names}
        for path in loads.glob("*.load"):
            if path.name not in kept:
                _remove(path)
        for file_name, command in kept.items():
            _keep(loads / file_name, command)
        self._write_index(names)

    def _write_index(self, loaded: Iterable[str]) -> None:
        index = {"models": sorted(set(loaded))}
        _replace(self.folder / INDEX, json.dumps(index).encode())

    def restore(self) -> tuple[set[str], dict[str, ControlCommand]] | None:
        """The models of the last snapshot and the load commands of those that had one; None
        where there is no snapshot, or it cannot be read (with a warning)."""
        index_path = self.folder / INDEX
        try:
            index = json.loads(_read_bounded(index_path, INDEX_MAX_BYTES))
            names = index["models"]
            if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
                raise ValueError("'models' is not a list of model names")
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError, RecursionError) as exc:
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
        raw = _read_bounded(path, RECORD_MAX_BYTES)
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


def _keep(path: Path, command: ControlCommand) -> None:
    """Keep in ``path`` how ``command`` loaded its model, where it brought a configuration,
    files or versions of its own and is not larger than the bound; else remove it."""
    own = command.config is not None or command.files or command.versions
    data = encode_command(command)[_FIELD] if command.op == "load" and own else b""
    if len(data) > RECORD_MAX_BYTES:
        log.warning(
            "not keeping how '%s' was loaded in the model snapshot: %d MiB, more than %d MiB",
            command.model,
            len(data) >> 20,
            RECORD_MAX_BYTES >> 20,
        )
        data = b""
    if data:
        _replace(path, data)
    else:
        _remove(path)


def _file_name(model: str) -> str:
    """A file name for any model name: a digest, so that neither a separator nor a dot
    reaches the path, and a name of 255 bytes gives no name too long for the file system
    (the record names its model, which :func:`_read` checks)."""
    digest = hashlib.sha256(model.encode(errors="surrogatepass")).hexdigest()
    return digest + ".load"


def _read_bounded(path: Path, limit: int) -> bytes:
    """The bytes of the regular file ``path``; OSError for another kind of file (opened
    without blocking: a FIFO would wait for a writer for ever) or one over ``limit`` bytes."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as file:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise OSError(errno.EINVAL, "not a regular file")
        if info.st_size > limit:
            raise OSError(errno.EFBIG, f"larger than {limit} bytes")
        data = file.read(info.st_size + 1)
    if len(data) > limit:
        raise OSError(errno.EFBIG, f"larger than {limit} bytes")
    return data


def _replace(path: Path, data: bytes) -> None:
    """Write ``data`` in ``path`` in one step: a staged file of this write's own (another
    executor may write the same folder), on disk before it takes the previous one's place."""
    fd, staged = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".new", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(staged, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(staged)
        raise
    sync_folder(path.parent)


def _remove(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        return
    sync_folder(path.parent)
