"""TorchServe's per-model configuration inside an archive (model-config.yaml): the keys
Sluice applies, the ones it names as ignored, and bad values refused by name."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest

from sluice.core.errors import InvalidConfig
from sluice.core.torchserve.archives import MANIFEST, read_manifest
from sluice.core.torchserve.settings import (
    ArchiveSettings,
    parse_archive_settings,
    read_archive_settings,
)


def _archive(tmp_path: Path, config: str | None, config_file: str = "model-config.yaml") -> Path:
    model = {"modelName": "m", "handler": "h.py", "modelVersion": "1.0", "configFile": config_file}
    path = tmp_path / "m.mar"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(MANIFEST, json.dumps({"model": model}))
        if config is not None:
            archive.writestr(config_file, config)
    return path


def test_the_keys_with_an_equivalent_are_read_and_the_rest_named(tmp_path: Path) -> None:
    path = _archive(
        tmp_path,
        "minWorkers: 2\nmaxWorkers: 4\nbatchSize: 8\nmaxBatchDelay: 50\nresponseTimeout: 30\n"
        "deviceType: GPU\nparallelType: pp\ntorchrun:\n  nproc-per-node: 2\n"
        "handler:\n  vocab: vocab.txt\n",
    )
    settings = read_archive_settings(path, read_manifest(path))
    assert settings == ArchiveSettings(
        min_workers=2,
        max_workers=4,
        batch_size=8,
        max_batch_delay_ms=50,
        response_timeout_s=30,
        gpu=True,
        ignored=("parallelType", "torchrun"),
    )
    line = settings.ignored_line("m")
    assert "model 'm'" in line and "parallelType, torchrun" in line and "\n" not in line
    assert ArchiveSettings().ignored_line("m") == ""


def test_an_archive_without_a_config_file_sets_nothing(tmp_path: Path) -> None:
    path = tmp_path / "plain.mar"
    with zipfile.ZipFile(path, "w") as archive:
        manifest = {"model": {"modelName": "m", "handler": "h", "modelVersion": "1.0"}}
        archive.writestr(MANIFEST, json.dumps(manifest))
    assert read_archive_settings(path, read_manifest(path)) == ArchiveSettings()
    assert parse_archive_settings(b"", "x") == ArchiveSettings()


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("batchSize: four\n", "batchSize must be a whole number of at least 1, got 'four'"),
        ("batchSize: 0\n", "batchSize must be a whole number of at least 1, got 0"),
        ("minWorkers: -1\n", "minWorkers must be a whole number of at least 0"),
        ("maxBatchDelay: true\n", "maxBatchDelay must be a whole number"),
        ("responseTimeout: 0\n", "responseTimeout must be a whole number of at least 1"),
        ("minWorkers: 3\nmaxWorkers: 2\n", r"maxWorkers \(2\) is below minWorkers \(3\)"),
        ("deviceType: tpu\n", "deviceType must be cpu or gpu, got 'tpu'"),
        ("- a\n- b\n", "must be a mapping"),
        ("a: [\n", "is not YAML"),
        ("a: !!python/object/apply:os.system [true]\n", "is not YAML .*constructor"),
        ("parallelType: " + "9" * 5000 + "\n", "is not YAML .*digits"),
        ("torchrun: 2024-13-45\n", "is not YAML .*month must be in"),
        ("a: " + "[" * 5000 + "]" * 5000 + "\n", "is not YAML .*nested too deeply"),
        ("batchSize: 2147483648\n", "batchSize must be at most 2147483647"),
    ],
)
def test_bad_values_are_refused_by_name(tmp_path: Path, text: str, reason: str) -> None:
    path = _archive(tmp_path, text)
    with pytest.raises(InvalidConfig, match=rf"model archive m\.mar: model-config\.yaml.*{reason}"):
        read_archive_settings(path, read_manifest(path))


def test_a_config_file_the_archive_does_not_hold_is_refused(tmp_path: Path) -> None:
    path = _archive(tmp_path, None, "missing.yaml")
    with pytest.raises(InvalidConfig, match=r"names 'missing\.yaml', which the archive does not"):
        read_archive_settings(path, read_manifest(path))
