"""The generated reference pages (docs/reference/) say what the code says now.

A failure here means the code changed and the pages did not: run
``python docs/gen_reference.py`` and commit the pages it writes.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[3]
GENERATOR = ROOT / "docs" / "gen_reference.py"
REFERENCE = ROOT / "docs" / "reference"

# Where the code reads or names SLUICE_* variables (as `git grep -ohE "SLUICE_[A-Z0-9_]+"`).
SOURCE_DIRS = ("sluice", "gateway", "workers", "scheduler", "batch")
VARIABLE = re.compile(r"SLUICE_[A-Z0-9_]+")

# Matches of VARIABLE in the code that are no variable a reader could set.
NOT_VARIABLES = {
    "SLUICE_KEYS": "the tail of `_SLUICE_KEYS`, the OpenVINO backend's set of parameter names",
    "SLUICE_LOG_": "`SLUICE_LOG_*` in a docstring: the SLUICE_LOG_ settings, each on the page",
}


@pytest.fixture(scope="module")
def generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_reference", GENERATOR)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def pages(generator: ModuleType) -> dict[str, str]:
    rendered: dict[str, str] = generator.render_pages()
    return rendered


def _code_variables() -> set[str]:
    found: set[str] = set()
    for folder in SOURCE_DIRS:
        for directory, subdirs, files in os.walk(ROOT / folder):  # links are not followed
            subdirs[:] = [d for d in subdirs if d != "__pycache__"]
            for name in files:
                try:
                    text = (Path(directory) / name).read_text(encoding="utf-8")
                except (UnicodeDecodeError, OSError):
                    continue
                found.update(VARIABLE.findall(text))
    return found


def test_the_pages_are_the_ones_the_mkdocs_nav_lists(pages: dict[str, str]) -> None:
    assert sorted(pages) == ["cli.md", "errors.md", "redis-layout.md", "settings.md"]


def test_every_page_is_current(generator: ModuleType, pages: dict[str, str]) -> None:
    stale = generator.stale_pages(pages, REFERENCE)
    assert not stale, f"stale: {stale}; run `python docs/gen_reference.py`"


def test_a_changed_page_is_named_stale(
    generator: ModuleType, pages: dict[str, str], tmp_path: Path
) -> None:
    generator.write_pages(pages, tmp_path)
    assert generator.stale_pages(pages, tmp_path) == []
    (tmp_path / "errors.md").write_text(pages["errors.md"] + "edited by hand\n")
    (tmp_path / "cli.md").unlink()
    assert generator.stale_pages(pages, tmp_path) == ["cli.md", "errors.md"]


@pytest.mark.slow
def test_check_mode_exits_zero_on_the_committed_pages() -> None:
    result = subprocess.run(
        [sys.executable, str(GENERATOR), "--check"], capture_output=True, text=True, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr


def test_every_sluice_variable_in_the_code_is_on_the_settings_page(
    pages: dict[str, str],
) -> None:
    documented = set(VARIABLE.findall(pages["settings.md"]))
    missing = _code_variables() - documented - set(NOT_VARIABLES)
    assert not missing, f"SLUICE_ variables the settings page lacks: {sorted(missing)}"


def test_the_exceptions_still_occur_in_the_code() -> None:
    assert set(NOT_VARIABLES) <= _code_variables()


def test_every_setting_has_a_section(generator: ModuleType, pages: dict[str, str]) -> None:
    headings = set(re.findall(r"^### (\S+)$", pages["settings.md"], re.MULTILINE))
    variables: set[str] = {
        variable
        for cls in generator.settings_classes()
        for field in cls.model_fields
        for variable in generator.field_variables(cls, field)[:1]
    }
    assert variables and variables <= headings


def test_every_cli_option_is_on_the_cli_page(generator: ModuleType, pages: dict[str, str]) -> None:
    options: set[str] = generator.cli_options()
    assert {"--model-repository", "--no-gateway", "-i"} <= options
    missing = {option for option in options if f"`{option}`" not in pages["cli.md"]}
    assert not missing, f"options the CLI page lacks: {sorted(missing)}"


def test_every_command_has_a_section(generator: ModuleType, pages: dict[str, str]) -> None:
    for path, _ in generator.walk_commands():
        assert f"\n## {' '.join(path)}\n" in pages["cli.md"]


def test_every_key_and_error_is_on_its_page(generator: ModuleType, pages: dict[str, str]) -> None:
    for name in generator.documented_keys():
        assert name in pages["redis-layout.md"], name
    for cls in generator.error_classes():
        assert f"\n### {cls.__name__}\n" in pages["errors.md"]


def test_pages_name_no_machine_path(pages: dict[str, str]) -> None:
    for name, text in pages.items():
        assert str(ROOT) not in text, name
        assert str(Path.home()) not in text, name
