"""``sluice import-mar``: a TorchServe model store (its models, and optionally its
``config.properties``) laid out as a Triton repository Sluice serves.

A store holds models in three forms: ``.mar`` archives, ``.tar.gz`` archives and unarchived
folders (:mod:`sluice.core.torchserve.forms`); each becomes ``<repository>/<modelName>/<version>/
model.mar`` (the other forms packed into one), and the archives of one model name are its
versions (the manifest's ``modelVersion``: :mod:`sluice.core.torchserve.versions`). Each model gets
a config.pbtxt for the ``torchserve`` backend (:func:`sluice.core.torchserve.config.triton_config`).
Its settings, in order of precedence: the archive's own ``model-config.yaml``
(:mod:`sluice.core.torchserve.settings`; of the default version when there are several), then from
``config.properties`` per model (``models=`` JSON) ``batchSize``, ``maxBatchDelay``,
``minWorkers``, ``maxWorkers`` and ``responseTimeout``, then ``default_workers_per_model``,
``job_queue_size`` and ``default_response_timeout``. Every other key is reported as ignored,
never silently dropped.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

from sluice.core.errors import InvalidConfig
from sluice.core.torchserve.archives import MANIFEST, MarManifest, UnpackLimits, read_manifest
from sluice.core.torchserve.config import check_model_name, triton_config
from sluice.core.torchserve.forms import form_of, is_model_entry, pack
from sluice.core.torchserve.settings import ArchiveSettings, read_archive_settings
from sluice.core.torchserve.versions import VersionRecord, decimal_of, find, number_for

log = logging.getLogger("sluice.import_mar")

TAKEN_KEYS = frozenset(
    {"models", "default_workers_per_model", "job_queue_size", "default_response_timeout"}
)
_MODEL_KEYS = frozenset(
    {"batchSize", "maxBatchDelay", "minWorkers", "maxWorkers", "responseTimeout"}
)
_NAMING_KEYS = frozenset({"defaultVersion", "marName"})
"""Which archive and version an entry describes: read, not settings."""


@dataclass
class StoreSettings:
    """What ``config.properties`` says that Sluice uses, and what it ignores."""

    workers: int = 1
    queue_size: int = 0
    response_timeout_s: int = 0
    models: dict[str, dict[str, Any]] = field(default_factory=dict)
    versions: dict[str, str] = field(default_factory=dict)
    """Each model's default version (``defaultVersion``), when one is marked."""
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
            default = next(
                (k for k, v in versions.items() if isinstance(v, dict) and v.get("defaultVersion")),
                None,
            )
            chosen = versions[default] if default is not None else next(iter(versions.values()))
            if not isinstance(chosen, dict):
                raise InvalidConfig(f"config.properties: models.{name} must map to objects")
            settings.models[name] = chosen
            if default is not None:
                settings.versions[name] = str(default)
            settings.ignored += [
                f"models.{name}.{key}" for key in chosen if key not in _MODEL_KEYS | _NAMING_KEYS
            ]
    settings.ignored += sorted(key for key in properties if key not in TAKEN_KEYS)
    return settings


@dataclass(frozen=True)
class _Found:
    """One model of the store, as a .mar (packed into the scratch folder if need be)."""

    source: Path
    mar: Path
    manifest: MarManifest
    settings: ArchiveSettings


def _sources(sources: list[Path]) -> list[Path]:
    """The models named: files, model folders, and the models of store folders."""
    found: list[Path] = []
    for source in sources:
        if source.is_dir() and not (source / MANIFEST).is_file():
            found += sorted(p for p in source.iterdir() if is_model_entry(p))
        elif source.is_file() or source.is_dir():
            found.append(source)
        else:
            raise InvalidConfig(f"{source} is neither a model archive nor a folder")
    if not found:
        raise InvalidConfig("no model found (.mar, .tar.gz or a folder with MAR-INF/MANIFEST.json)")
    return found


def _read(source: Path, scratch: Path) -> _Found:
    if form_of(source) == "mar":
        mar = source
        manifest = read_manifest(source)
    else:
        mar = scratch / f"{len(list(scratch.iterdir()))}.mar"
        manifest = pack(source, mar, UnpackLimits())
    return _Found(source, mar, manifest, read_archive_settings(mar, manifest))


def import_archives(
    sources: list[Path], repository: Path, settings: StoreSettings, *, force: bool = False
) -> list[str]:
    """Lay out every model of ``sources`` (archives, model folders, or store folders) in
    ``repository``; returns the model names. An existing model folder is an error unless
    ``force``."""
    entries = _sources(sources)
    repository.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".import-mar-", dir=repository))
    try:
        models: dict[str, list[_Found]] = {}
        for entry in entries:
            found = _read(entry, scratch)
            models.setdefault(found.manifest.model_name, []).append(found)
        plans = {name: _versions(name, found) for name, found in models.items()}
        for name, versions in plans.items():
            _lay_out(name, versions, repository, settings, force)
        return list(plans)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _versions(name: str, found: list[_Found]) -> dict[int, _Found]:
    """The model's archives by version number (whole versions first keep their numbers)."""
    check_model_name(name, found[0].source.name)
    numbers: dict[int, _Found] = {}
    taken: dict[int, str] = {}
    for item in sorted(found, key=_whole_first):
        version = item.manifest.version
        same = find(version, taken)
        if same is not None:
            raise InvalidConfig(
                f"model '{name}' version {version} is in both {numbers[same].source.name} "
                f"and {item.source.name}"
            )
        number = number_for(version, taken, f"model archive {item.source.name}")
        numbers[number], taken[number] = item, version
    return dict(sorted(numbers.items()))


def _whole_first(found: _Found) -> tuple[int, Decimal, str]:
    """Whole positive versions first (they keep their numbers where free), then the other
    numbers, then versions that are no number (``v1``), each kind in order."""
    value = decimal_of(found.manifest.version)
    if value is None or value <= 0:
        return (2, Decimal(0), found.source.name)
    return (0 if value == value.to_integral_value() else 1, value, found.source.name)


def _lay_out(
    name: str, versions: dict[int, _Found], repository: Path, store: StoreSettings, force: bool
) -> None:
    own = store.models.get(name, {})
    default = _default_version(versions, store.versions.get(name))
    archive = versions[default].settings
    line = archive.ignored_line(name)
    if line:
        log.warning("%s", line)

    def pick(mine: int | None, key: str, fallback: int) -> int:
        return mine if mine is not None else _whole(own.get(key, fallback), f"models.{name}.{key}")

    workers = pick(archive.min_workers, "minWorkers", store.workers)
    config = triton_config(
        name,
        pick(archive.batch_size, "batchSize", 1),
        pick(archive.max_batch_delay_ms, "maxBatchDelay", 100),
        workers=workers,
        max_workers=pick(archive.max_workers, "maxWorkers", max(1, workers)),
        queue_size=store.queue_size,
        response_timeout_s=pick(
            archive.response_timeout_s, "responseTimeout", store.response_timeout_s
        ),
        gpu=bool(archive.gpu),
        versions={
            number: VersionRecord(found.manifest.version, found.source.name)
            for number, found in versions.items()
        },
    )
    target = repository / name
    if target.exists():
        if not force:
            raise InvalidConfig(f"{target} exists already (--force replaces it)")
        shutil.rmtree(target)
    for number, found in versions.items():
        (target / str(number)).mkdir(parents=True)
        if found.mar == found.source:
            shutil.copyfile(found.mar, target / str(number) / "model.mar")
        else:  # packed in the scratch folder
            found.mar.replace(target / str(number) / "model.mar")
    (target / "config.pbtxt").write_text(config)


def _default_version(versions: dict[int, _Found], named: str | None) -> int:
    """The version whose settings the model takes: config.properties' ``defaultVersion``,
    else the lowest (TorchServe's default is the first registered)."""
    if named is not None:
        number = find(named, {n: f.manifest.version for n, f in versions.items()})
        if number is not None:
            return number
    return min(versions)
