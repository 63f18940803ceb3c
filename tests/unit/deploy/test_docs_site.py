"""The documentation site and the README that leads into it.

The site (mkdocs.yml, docs/) must build with ``mkdocs build --strict`` and no warning at all:
a page left out of the navigation, a link to a missing page, or an anchor that no heading
makes all fail it. The README is a landing page: small, and every link it has leads to a file
of the repository (and, for a Markdown page, to a heading that exists).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
README = ROOT / "README.md"
README_LIMIT_BYTES = 12 * 1024

_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)


def _links(markdown: str) -> list[str]:
    """The targets of the inline links, outside code blocks and code spans."""
    text = _FENCE.sub("", markdown)
    text = re.sub(r"`[^`\n]*`", "", text)
    return _LINK.findall(text)


def _anchors(markdown: str) -> set[str]:
    """The ids Python-Markdown's toc extension gives the headings of a page."""
    anchors = set()
    for line in _FENCE.sub("", markdown).splitlines():
        heading = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading:
            title = re.sub(r"[`*_]", "", heading.group(1))
            slug = re.sub(r"[^\w\s-]", "", title).strip().lower()
            anchors.add(re.sub(r"[-\s]+", "-", slug))
    return anchors


@pytest.mark.slow
def test_the_site_builds_strict_without_a_warning(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = result.stdout + result.stderr
    warnings = [line for line in output.splitlines() if "WARNING" in line]
    assert result.returncode == 0, output
    assert not warnings, "\n".join(warnings)
    assert (tmp_path / "index.html").is_file()


def test_the_readme_is_a_landing_page_of_at_most_12_kb() -> None:
    size = len(README.read_bytes())
    assert size <= README_LIMIT_BYTES, (
        f"README.md is {size} bytes (limit {README_LIMIT_BYTES}): move the detail into docs/"
    )


def test_the_readme_links_only_to_files_that_exist() -> None:
    broken = []
    for target in _links(README.read_text()):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...: not a file
            continue
        path, _, anchor = target.partition("#")
        file = (ROOT / path).resolve() if path else README
        if not file.exists() or not file.is_relative_to(ROOT):
            broken.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file.read_text()):
            broken.append(f"{target}: no heading makes #{anchor}")
    assert not broken, "\n".join(broken)


def test_the_readme_has_links_into_the_docs() -> None:
    """A guard on the link test itself: it would pass on a README with no link at all."""
    targets = _links(README.read_text())
    assert "docs/index.md" in targets
    assert "docs/getting-started.md" in targets
