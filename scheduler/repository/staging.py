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
from sluice.core.errors import InvalidInput
from sluice.core.repository import CUSTOM_CONFIGS

_REPLACED = frozenset((CONFIG_FILENAME, CUSTOM_CONFIGS))
"""What a load's configuration replaces in the model's folder."""

MAX_FILES = 1000


def check_model_name(name: str) -> None:
    """A model name that names one directory of the repository, nothing else."""
    if (
        not name
        or name in (".", "..")
        or name.startswith(".")
        or "/" in name
        or "\\" in name
        or "\0" in name
        or len(name) > 255
    ):
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
    ``model_dir``'s (whose entries the files do not touch are linked)."""
    name = model_dir.name
    if config_json is None and not files:
        return model_dir
    if files and config_json is None:
        raise InvalidInput(
            f"failed to load '{name}', model configuration must be provided when files are "
            "overridden"
        )
    staged = staging_root / name
    if staged.exists():
        shutil.rmtree(staged)
    staged.mkdir(parents=True)
    if files:
        if len(files) > MAX_FILES:
            raise InvalidInput(f"failed to load '{name}', more than {MAX_FILES} files")
        relative = [_safe_relative(name, path) for path in files]
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
    assert config_json is not None
    (staged / CONFIG_FILENAME).write_text(_config_text(name, config_json))
    return staged


def _safe_relative(name: str, path: str) -> PurePosixPath:
    relative = PurePosixPath(path)
    if (
        not path
        or "\\" in path
        or "\0" in path
        or relative.is_absolute()
        or any(part in ("", ".", "..") for part in relative.parts)
        or (relative.name == CONFIG_FILENAME and len(relative.parts) == 1)
    ):
        raise InvalidInput(f"failed to load '{name}', invalid file override path '{path}'")
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
