"""TorchServe models made with the real ``torch-model-archiver`` (from PyPI, in the
``torchserve`` extra), in any of its forms: a .mar, a .tar.gz or an unarchived folder."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx

from tests.support.stack import Stack

ARCHIVER = Path(sys.executable).parent / "torch-model-archiver"
WORKFLOW_ARCHIVER = Path(sys.executable).parent / "torch-workflow-archiver"


def _private_tmp(scratch: Path) -> dict[str, str]:
    """An environment whose temporary folder is ``scratch``'s own: both archivers stage
    their files in ``$TMPDIR/<name>``, removing what was there first, so two tests archiving
    one name at once (two test streams) would remove each other's."""
    (scratch / "tmp").mkdir(exist_ok=True)
    return dict(os.environ, TMPDIR=str(scratch / "tmp"))


_SUFFIX = {"default": ".mar", "tgz": ".tar.gz", "no-archive": ""}


def make_archive(
    store: Path,
    name: str,
    handler: str,
    *,
    version: str = "1.0",
    serialized: Path | None = None,
    extra: dict[str, str] | tuple[Path, ...] = (),
    config: str | None = None,
    archive_format: str = "default",
    file_name: str | None = None,
) -> Path:
    """Archive ``handler`` (the source of handler.py) as model ``name`` into ``store``;
    ``extra``: more files (name -> text, or paths), ``config``: a model-config.yaml.
    ``file_name``: the result's name in the store (default: what the archiver names it).
    Returns the archive (or folder) written."""
    store.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="mar-src-") as scratch:
        source = Path(scratch)
        (source / "handler.py").write_text(handler)
        command = [
            str(ARCHIVER),
            "--model-name",
            name,
            "--version",
            version,
            "--handler",
            str(source / "handler.py"),
            "--export-path",
            str(source),
            "--archive-format",
            archive_format,
        ]
        if serialized is not None:
            command += ["--serialized-file", str(serialized)]
        files = list(extra) if isinstance(extra, tuple) else []
        if isinstance(extra, dict):
            (source / "extra").mkdir()
            for file, text in extra.items():
                (source / "extra" / file).write_text(text)
                files.append(source / "extra" / file)
        if files:
            command += ["--extra-files", ",".join(str(path) for path in files)]
        if config is not None:
            (source / "model-config.yaml").write_text(config)
            command += ["--config-file", str(source / "model-config.yaml")]
        subprocess.run(
            command, check=True, capture_output=True, timeout=120, env=_private_tmp(source)
        )
        made = source / f"{name}{_SUFFIX[archive_format]}"
        target = store / (file_name or made.name)
        shutil.move(made, target)
    return target


def import_mar(*args: str) -> subprocess.CompletedProcess[str]:
    """``sluice import-mar ARGS...`` as a user runs it (its output captured)."""
    return subprocess.run(
        [sys.executable, "-m", "sluice.cli", "import-mar", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def import_with_models(store: Path, models: dict[str, Any]) -> Path:
    """Import ``store``'s archives with ``sluice import-mar``, given a ``config.properties``
    whose ``models`` is ``models`` (TorchServe's per-model batch settings), into a
    repository beside ``store``; the repository's path."""
    properties = store.parent / "config.properties"
    properties.write_text(f"models={json.dumps(models)}\n")
    repository = store.parent / "repository"
    imported = import_mar(
        str(store), "--model-repository", str(repository), "--config-properties", str(properties)
    )
    assert imported.returncode == 0, imported.stderr
    return repository


def make_workflow(
    store: Path, name: str, spec: str, handler: str, *, extra: dict[str, str] | None = None
) -> Path:
    """Archive a workflow with the real ``torch-workflow-archiver`` into ``store``: ``spec``
    (its YAML), ``handler`` (the source of its functions), ``extra`` files (name -> text).
    Returns the .war written."""
    store.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="war-src-") as scratch:
        source = Path(scratch)
        (source / "spec.yaml").write_text(spec)
        (source / "handler.py").write_text(handler)
        command = [
            str(WORKFLOW_ARCHIVER),
            "--workflow-name",
            name,
            "--spec-file",
            str(source / "spec.yaml"),
            "--handler",
            str(source / "handler.py"),
            "--export-path",
            str(source),
        ]
        if extra:
            for file, text in extra.items():
                (source / file).write_text(text)
            command += ["--extra-files", ",".join(str(source / file) for file in extra)]
        subprocess.run(
            command, check=True, capture_output=True, timeout=120, env=_private_tmp(source)
        )
        target = store / f"{name}.war"
        shutil.move(source / f"{name}.war", target)
    return target


def store_stack(root: Path, redis_url: str, store: Path, *args: str) -> Stack:
    """A stack (not started) in explicit model control over an empty repository, whose
    TorchServe management API registers from model store ``store``; ``args``: more of
    ``sluice up``'s."""
    (root / "repository").mkdir()
    return Stack(
        root / "repository",
        redis_url,
        env={"SLUICE_MODEL_STORE": str(store)},
        args=["--model-control-mode", "explicit", *args],
    )


def said(answer: httpx.Response, code: int) -> str:
    """What TorchServe's answer said (its ``status``, or its error's ``message``); it must
    be ``code``."""
    assert answer.status_code == code, answer.text
    body = answer.json()
    return str(body.get("status") or body.get("message"))
