"""The wheel a user installs: one top-level import name, typed, licensed, nothing else.

The services' folders stay at the top of the repository and reach the wheel through the
links under ``sluice/``; ``bench/``, the tests and the model builders must not."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
SOURCES = (
    "pyproject.toml",
    "README.md",
    "LICENSE",
    "sluice",
    "gateway",
    "workers",
    "scheduler",
    "batch",
)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    """The wheel built from a copy of the sources (the build leaves nothing in the checkout)."""
    tree = tmp_path_factory.mktemp("tree")
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for name in SOURCES:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, tree / name, symlinks=True, ignore=ignore)
        else:
            shutil.copy2(source, tree / name)
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-w",
            str(out),
            str(tree),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    [built] = out.glob("sluice-*.whl")
    return zipfile.ZipFile(built)


@pytest.mark.slow
def test_the_wheel_installs_one_top_level_name(wheel: zipfile.ZipFile) -> None:
    [top_level] = [n for n in wheel.namelist() if n.endswith(".dist-info/top_level.txt")]
    assert wheel.read(top_level).decode().split() == ["sluice"]
    tops = {name.split("/", 1)[0] for name in wheel.namelist()}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"sluice"}


@pytest.mark.slow
def test_the_services_are_inside_it_and_bench_and_tests_are_not(wheel: zipfile.ZipFile) -> None:
    names = set(wheel.namelist())
    for module in (
        "gateway/app.py",
        "workers/worker.py",
        "scheduler/executor/up.py",
        "batch/app.py",
        "core/errors.py",
        "cli/__init__.py",
        "client/__init__.py",
    ):
        assert f"sluice/{module}" in names, module
    assert not [n for n in names if "/bench/" in n or "/tests/" in n or "model_builders" in n]


@pytest.mark.slow
def test_it_is_typed_and_licensed(wheel: zipfile.ZipFile) -> None:
    names = wheel.namelist()
    assert "sluice/py.typed" in names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    [metadata] = [n for n in names if n.endswith(".dist-info/METADATA")]
    assert "License-Expression: Apache-2.0" in wheel.read(metadata).decode()
