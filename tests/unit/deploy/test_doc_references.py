"""Names the documentation gives still exist: the modules, classes and functions that
docstrings cross-reference (``:mod:`sluice...```), and the modules and repository paths
that the docs pages and the README name in backquotes. A move that leaves a reader at a
name that is gone fails here."""

from __future__ import annotations

import importlib
import importlib.util
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
CROSS_REFERENCE = re.compile(r":(?:mod|func|class|data|meth|attr|exc):`~?(sluice(?:\.\w+)+)`")
QUOTED_MODULE = re.compile(r"`(sluice(?:\.\w+)+)`")
QUOTED_PATH = re.compile(
    r"`((?:gateway|workers|scheduler|batch|sluice|tests|bench|deploy|examples|scripts|docs|"
    r"model_repository)/[\w./-]*)`"
)
SERVICE_PREFIX = re.compile(
    r":(?:mod|func|class|data|meth|attr|exc):`~?(?:gateway|workers|scheduler|batch)\."
)
# Model configuration parameters (sluice.rollout, sluice.rollout_steps, ...) and label keys
# that happen to look like module names.
NOT_MODULES = re.compile(
    r"sluice\.(rollout(_\w+)?|dev|load|pinned|min_instances|max_instances"
    r"|latency_objective_ms|scale_down_window_s)"
)


def _resolves(dotted: str) -> bool:
    """A module, or an attribute path inside the longest module prefix."""
    parts = dotted.split(".")
    for cut in range(len(parts), 1, -1):
        name = ".".join(parts[:cut])
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        if spec is None:
            continue
        target: object = importlib.import_module(name)
        for attribute in parts[cut:]:
            if not hasattr(target, attribute):
                return False
            target = getattr(target, attribute)
        return True
    return False


def _python_sources() -> list[Path]:
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return [ROOT / name for name in listed if (ROOT / name).is_file()]


def _pages() -> list[Path]:
    return [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md"))]


@pytest.mark.slow
def test_docstring_cross_references_resolve() -> None:
    stale = {
        f"{path.relative_to(ROOT)}: {name}"
        for path in _python_sources()
        for name in CROSS_REFERENCE.findall(path.read_text())
        if not _resolves(name)
    }
    assert not stale, sorted(stale)


def test_docstrings_name_services_by_their_import_name() -> None:
    old = [
        str(path.relative_to(ROOT))
        for path in _python_sources()
        if SERVICE_PREFIX.search(path.read_text())
    ]
    assert not old, f"write sluice.gateway..., not gateway...: {old}"


@pytest.mark.slow
def test_modules_and_paths_named_in_the_docs_exist() -> None:
    stale: set[str] = set()
    for page in _pages():
        text = page.read_text()
        for name in QUOTED_MODULE.findall(text):
            if not NOT_MODULES.fullmatch(name) and not _resolves(name):
                stale.add(f"{page.relative_to(ROOT)}: {name}")
        for path in QUOTED_PATH.findall(text):
            path = path.rstrip(".,:;")
            if "*" not in path and "<" not in path and not (ROOT / path).exists():
                stale.add(f"{page.relative_to(ROOT)}: {path}")
    assert not stale, sorted(stale)
