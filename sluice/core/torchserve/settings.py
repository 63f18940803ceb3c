"""TorchServe's per-model configuration inside an archive (``model-config.yaml``, packed by
``torch-model-archiver --config-file`` and named by the manifest's ``model.configFile``):
the keys that have a Sluice equivalent.

``minWorkers`` and ``maxWorkers`` (instances, and autoscaling between them), ``batchSize``,
``maxBatchDelay`` (milliseconds), ``responseTimeout`` (seconds) and ``deviceType``
(``cpu`` / ``gpu``: the instances' kind) are applied. Every other top-level key
(``parallelType``, ``deviceIds``, ``torchrun``, ``startupTimeout``, ...) is reported as
ignored, except ``handler``: the section handlers read for themselves. The handler sees the
whole file either way, as ``context.model_yaml_config``. A value of the wrong kind is
refused, naming the key (TorchServe logs it and goes on with its default).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from sluice.core.errors import InvalidConfig
from sluice.core.torchserve.archives import MarManifest, read_member

MAX_CONFIG_BYTES = 1 << 20
HANDLER_SECTION = "handler"
"""The section of ``model-config.yaml`` that belongs to the handler (never reported)."""
_WHOLE = {
    "minWorkers": 0,
    "maxWorkers": 0,
    "batchSize": 1,
    "maxBatchDelay": 0,
    "responseTimeout": 1,
}
"""The whole-number keys, each with its least value."""
MAX_WHOLE = (1 << 31) - 1
"""Their largest value (TorchServe reads them as Java ints)."""


@dataclass(frozen=True, slots=True)
class ArchiveSettings:
    """What an archive's ``model-config.yaml`` sets (None: not set)."""

    min_workers: int | None = None
    max_workers: int | None = None
    batch_size: int | None = None
    max_batch_delay_ms: int | None = None
    response_timeout_s: int | None = None
    gpu: bool | None = None
    """``deviceType``: gpu (True) or cpu (False)."""
    ignored: tuple[str, ...] = ()
    """The keys Sluice has no equivalent for, sorted."""

    def ignored_line(self, model: str) -> str:
        """The one log line naming the ignored keys ("" when there are none)."""
        if not self.ignored:
            return ""
        return (
            f"model '{model}': model-config.yaml keys with no Sluice equivalent, ignored: "
            f"{', '.join(self.ignored)} (the handler still reads them in "
            "context.model_yaml_config)"
        )


def read_archive_settings(path: Path, manifest: MarManifest) -> ArchiveSettings:
    """The settings of the archive at ``path`` (a .mar); none when its manifest names no
    configuration file."""
    if not manifest.config_file:
        return ArchiveSettings()
    data = read_member(path, manifest.config_file, MAX_CONFIG_BYTES)
    return parse_archive_settings(data, f"model archive {path.name}: {manifest.config_file}")


def parse_archive_settings(data: bytes, where: str) -> ArchiveSettings:
    try:
        document = yaml.safe_load(data)
    except yaml.YAMLError as exc:
        reason = str(exc).replace("\n", " ")
        raise InvalidConfig(f"{where} is not YAML ({reason})") from None
    except RecursionError:
        raise InvalidConfig(f"{where} is not YAML (nested too deeply)") from None
    except (ValueError, OverflowError) as exc:  # a number too long to convert, a bad date
        raise InvalidConfig(f"{where} is not YAML ({exc})") from None
    if document is None:
        return ArchiveSettings()
    if not isinstance(document, dict):
        raise InvalidConfig(f"{where} must be a mapping of keys to values")
    values = {
        key: _whole(document[key], key, least, where)
        for key, least in _WHOLE.items()
        if key in document
    }
    minimum, maximum = values.get("minWorkers"), values.get("maxWorkers")
    if minimum is not None and maximum is not None and maximum < minimum:
        raise InvalidConfig(f"{where}: maxWorkers ({maximum}) is below minWorkers ({minimum})")
    gpu = None
    if "deviceType" in document:
        device = document["deviceType"]
        if not isinstance(device, str) or device.lower() not in ("cpu", "gpu"):
            raise InvalidConfig(f"{where}: deviceType must be cpu or gpu, got {device!r}")
        gpu = device.lower() == "gpu"
    known = {*_WHOLE, "deviceType", HANDLER_SECTION}
    return ArchiveSettings(
        min_workers=minimum,
        max_workers=maximum,
        batch_size=values.get("batchSize"),
        max_batch_delay_ms=values.get("maxBatchDelay"),
        response_timeout_s=values.get("responseTimeout"),
        gpu=gpu,
        ignored=tuple(sorted(str(key) for key in document if key not in known)),
    )


def _whole(value: Any, key: str, least: int, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise InvalidConfig(
            f"{where}: {key} must be a whole number of at least {least}, got {value!r}"
        )
    if value > MAX_WHOLE:
        raise InvalidConfig(f"{where}: {key} must be at most {MAX_WHOLE}")
    return value
