"""``sluice import-mar``: a TorchServe model store (``.mar`` archives, and optionally its
``config.properties``) laid out as a Triton repository Sluice serves.

Each archive becomes ``<repository>/<modelName>/1/model.mar`` with a config.pbtxt for the
``torchserve`` backend (:func:`sluice.core.mar.triton_config`). From ``config.properties`` the
settings that have a Sluice equivalent are taken: per model (``models=`` JSON)
``batchSize``, ``maxBatchDelay``, ``minWorkers`` and ``responseTimeout``;
``default_workers_per_model``, ``job_queue_size`` and ``default_response_timeout``. Every
other key is reported as ignored, never silently dropped.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sluice.core.errors import InvalidConfig
from sluice.core.mar import read_manifest, triton_config

TAKEN_KEYS = frozenset(
    {"models", "default_workers_per_model", "job_queue_size", "default_response_timeout"}
)
_MODEL_KEYS = frozenset({"batchSize", "maxBatchDelay", "minWorkers", "responseTimeout"})
_NAMING_KEYS = frozenset({"defaultVersion", "marName"})
"""Which archive and version an entry describes: read, not settings."""


@dataclass
class StoreSettings:
    """What ``config.properties`` says that Sluice uses, and what it ignores."""

    workers: int = 1
    queue_size: int = 0
    response_timeout_s: int = 0
    models: dict[str, dict[str, Any]] = field(default_factory=dict)
    ignored: list[str] = field(default_factory=list)


def parse_properties(text: str) -> dict[str, str]:
    """Java properties: ``key=value`` (or ``key: value``) lines, ``#``/``!`` comments, a
    trailing backslash continuing a line."""
    properties: dict[str, str] = {}
    logical = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not logical and (not line or line[0] in "#!"):
            continue
        if line.endswith("\\"):
            logical += line[:-1]
            continue
        logical += line
        separator = min((i for i in (logical.find("="), logical.find(":")) if i >= 0), default=-1)
        if separator < 0:
            properties[logical] = ""
        else:
            properties[logical[:separator].strip()] = logical[separator + 1 :].strip()
        logical = ""
    return properties


def _whole(value: Any, key: str) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise InvalidConfig(
            f"config.properties: {key} must be a whole number, got {value!r}"
        ) from None
    return number


def read_store_settings(path: Path | None) -> StoreSettings:
    settings = StoreSettings()
    if path is None:
        return settings
    try:
        properties = parse_properties(path.read_text())
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidConfig(f"cannot read {path}: {exc}") from None
    if "default_workers_per_model" in properties:
        settings.workers = _whole(
            properties["default_workers_per_model"], "default_workers_per_model"
        )
    if "job_queue_size" in properties:
        settings.queue_size = _whole(properties["job_queue_size"], "job_queue_size")
    if "default_response_timeout" in properties:
        settings.response_timeout_s = _whole(
            properties["default_response_timeout"], "default_response_timeout"
        )
    if "models" in properties:
        try:
            models = json.loads(properties["models"])
        except ValueError as exc:
            raise InvalidConfig(f"config.properties: models is not JSON ({exc})") from None
        if not isinstance(models, dict):
            raise InvalidConfig("config.properties: models must be a JSON object")
        for name, versions in models.items():
            if not isinstance(versions, dict) or not versions:
                raise InvalidConfig(f"config.properties: models.{name} must map versions")
            # The default version's settings, else the first listed.
            chosen = next(
                (v for v in versions.values() if isinstance(v, dict) and v.get("defaultVersion")),
                next(iter(versions.values())),
            )
            if not isinstance(chosen, dict):
                raise InvalidConfig(f"config.properties: models.{name} must map to objects")
            settings.models[name] = chosen
            settings.ignored += [
                f"models.{name}.{key}" for key in chosen if key not in _MODEL_KEYS | _NAMING_KEYS
            ]
    settings.ignored += sorted(key for key in properties if key not in TAKEN_KEYS)
    return settings


def import_archives(
    sources: list[Path], repository: Path, settings: StoreSettings, *, force: bool = False
) -> list[str]:
    """Lay out every archive of ``sources`` (files, or folders of ``*.mar``) in
    ``repository``; returns the model names. An existing model folder is an error unless
    ``force``."""
    archives: list[Path] = []
    for source in sources:
        if source.is_dir():
            archives += sorted(source.glob("*.mar"))
        elif source.is_file():
            archives.append(source)
        else:
            raise InvalidConfig(f"{source} is neither a .mar file nor a folder")
    if not archives:
        raise InvalidConfig("no .mar archive found")
    names: list[str] = []
    for archive in archives:
        manifest = read_manifest(archive)
        name = manifest.model_name
        if not name.replace("-", "_").replace(".", "_").isidentifier() or len(name) > 128:
            raise InvalidConfig(f"{archive.name}: model name {name!r} cannot be a folder name")
        own = settings.models.get(name, {})
        config = triton_config(
            name,
            _whole(own.get("batchSize", 1), f"models.{name}.batchSize"),
            _whole(own.get("maxBatchDelay", 100), f"models.{name}.maxBatchDelay"),
            workers=_whole(own.get("minWorkers", settings.workers), f"models.{name}.minWorkers"),
            queue_size=settings.queue_size,
            response_timeout_s=_whole(
                own.get("responseTimeout", settings.response_timeout_s),
                f"models.{name}.responseTimeout",
            ),
        )
        target = repository / name
        if target.exists():
            if not force:
                raise InvalidConfig(f"{target} exists already (--force replaces it)")
            shutil.rmtree(target)
        (target / "1").mkdir(parents=True)
        shutil.copyfile(archive, target / "1" / "model.mar")
        (target / "config.pbtxt").write_text(config)
        names.append(name)
    return names
