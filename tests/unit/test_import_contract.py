"""Imports go one way: the services import ``sluice``, never each other."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ("gateway", "workers", "scheduler", "batch")
COMPOSITION_ROOT = ROOT / "sluice" / "cli.py"


def imported_packages(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package", ["sluice", *SERVICES])
def test_imports_go_one_way(package: str) -> None:
    forbidden = set(SERVICES) - {package}
    offenders = {
        str(path.relative_to(ROOT)): sorted(imported_packages(path) & forbidden)
        for path in (ROOT / package).rglob("*.py")
        if path != COMPOSITION_ROOT
    }
    assert not {k: v for k, v in offenders.items() if v}
