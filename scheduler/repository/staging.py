"""The directory a model is loaded from, with the overrides of a load request applied.

Triton's load request may carry a configuration (``parameters.config``: the model
configuration as JSON) and model files (``parameters["file:<path>"]``, the bytes). With a
configuration only, the model's own directory is used with that configuration instead of
its ``config.pbtxt`` (and of its custom configurations, ``configs/``, which the staged
copy leaves out); with files, the model is made of the given configuration and files
alone (Triton requires the configuration then). The result is written to a fresh staging
directory, never into the repository; paths from the request are hostile and checked.
"""

from __future__ import annotations

import shutil
from pathlib import Path, PurePosixPath

from google.protobuf import json_format, text_format

from sluice.core.config import CONFIG_FILENAME
from sluice.core.config._schema import model_config_pb2
from sluice.core.config.paths import model_name_problem
from sluice.core.errors import InvalidInput, Unavailable
from sluice.core.repository import CUSTOM_CONFIGS
from sluice.scheduler.repository.sources import key_problem, path_conflict, show

_REPLACED = frozenset((CONFIG_FILENAME, CUSTOM_CONFIGS))
"""What a load's configuration replaces in the model's folder."""

MAX_FILES = 1000


def check_model_name(name: str) -> None:
    """A model name that names one directory of the repository, nothing else
    (:func:`~sluice.core.config.paths.model_name_problem`)."""
    if model_name_problem(name):
        raise InvalidInput(f"failed to load '{name}', invalid model name")


def stage(
    model_dir: Path,
    staging_root: Path,
    config_json: str | None,
    files: dict[str, bytes],
    *,
    keep: bool = False,
) -> Path:
    """``model_dir`` itself without overrides; else a staged copy under ``staging_root``
    (``<staging_root>/<name>``), made fresh. With ``keep``, the files are added to
    ``model_dir``'s (whose entries the files do not touch are linked).

    Everything the request names is checked before anything is written; a failure to write
    (a full disk) removes what was written and raises :class:`Unavailable`, so that the load
    is answered."""
    name = model_dir.name
    if config_json is None and not files:
        return model_dir
    if files and config_json is None:
        raise InvalidInput(
            f"failed to load '{name}', model configuration must be provided when files are "
            "overridden"
        )
    assert config_json is not None
    if len(files) > MAX_FILES:
        raise InvalidInput(f"failed to load '{name}', more than {MAX_FILES} files")
    relative = [_safe_relative(name, path) for path in files]
    clash = path_conflict(files)
    if clash is not None:
        raise InvalidInput(
            f"failed to load '{name}', file override path {show(clash)} is both a file and a folder"
        )
    config_text = _config_text(name, config_json)
    staged = staging_root / name
    try:
        if staged.exists():
            shutil.rmtree(staged)
        staged.mkdir(parents=True)
        if files:
            if keep and model_dir.is_dir():
                touched = {path.parts[0] for path in relative}
                for entry in model_dir.iterdir():
                    if entry.name not in _REPLACED and entry.name not in touched:
                        (staged / entry.name).symlink_to(entry.resolve())
            for path, content in zip(relative, files.values(), strict=True):
                target = staged / path
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(content)
        else:
            for entry in model_dir.iterdir():
                if entry.name not in _REPLACED:
                    (staged / entry.name).symlink_to(entry.resolve())
        (staged / CONFIG_FILENAME).write_text(config_text)
    except OSError as exc:
        shutil.rmtree(staged, ignore_errors=True)
        raise Unavailable(
            f"failed to load '{name}', cannot stage the model's files: {exc.strerror or exc}"
        ) from None
    return staged


def _safe_relative(name: str, path: str) -> PurePosixPath:
    """A file override's path, checked as it was given (``PurePosixPath`` would fold
    ``a//b`` and ``a/./b`` into ``a/b``, two overrides of one file) and as a key of a remote
    repository is (:func:`~sluice.scheduler.repository.sources.key_problem`: no ``..``, no
    absolute path, no control character, bounded lengths and depth)."""
    problem = key_problem(path)
    if problem is None and path == CONFIG_FILENAME:
        problem = "the load's configuration is the model's configuration file"
    if problem is not None:
        raise InvalidInput(
            f"failed to load '{name}', invalid file override path {show(path)}: {problem}"
        )
    relative = PurePosixPath(path)
    if relative.parts[0] == CUSTOM_CONFIGS:
        raise InvalidInput(
            f"failed to load '{name}', file override path '{path}': the load's configuration "
            f"replaces the model's custom configurations ({CUSTOM_CONFIGS}/)"
        )
    return relative


def _config_text(name: str, config_json: str) -> str:
    message = model_config_pb2().ModelConfig()
    try:
        json_format.Parse(config_json, message)
    except json_format.ParseError as exc:
        raise InvalidInput(
            f"failed to load '{name}', failed to parse the model configuration: {exc}"
        ) from None
    if message.name and message.name != name:
        raise InvalidInput(
            f"failed to load '{name}', the configuration names model '{message.name}'"
        )
    return str(text_format.MessageToString(message))
