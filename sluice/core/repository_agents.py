"""Triton's repository agents that a model's configuration names (``model_repository_agents``).

Triton runs each named agent before it loads the model, and the load fails when an agent
does, or when the agent is not installed. Sluice carries out Triton's ``checksum`` agent
itself: each of its parameters is ``<algorithm>:<file relative to the model's folder>`` ->
the file's expected digest (MD5, the one algorithm that agent knows), and a file that
does not match makes the model unavailable with Triton's text. Any other agent makes it
unavailable too, naming the agent, rather than serving what the agent would have checked
or changed.

A key's path stays inside the model's folder: an absolute path or one that climbs out of
it (``..``) is refused. Digests are computed when a model is read (a repository scan, a
load, a worker's start) and remembered per file, size and modification time, so a poll of
an unchanged repository does not read the files again.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Mapping
from pathlib import Path, PurePosixPath
from typing import Any

from sluice.core.config import ModelConfig
from sluice.core.errors import InvalidConfig

CHECKSUM_AGENT = "checksum"
_CHUNK = 1 << 20


def check_repository_agents(config: ModelConfig, model_dir: Path) -> None:
    """Raise InvalidConfig when an agent of ``config`` refuses the model in ``model_dir``."""
    section = config.raw.get("model_repository_agents") or {}
    for agent in section.get("agents") or ():
        name = str(agent.get("name", ""))
        if name != CHECKSUM_AGENT:
            raise InvalidConfig(
                f"repository agent '{name}' is not available: Sluice carries out Triton's "
                f"'{CHECKSUM_AGENT}' agent only"
            )
        _check_checksums(agent.get("parameters") or {}, model_dir)


def _check_checksums(parameters: Mapping[str, Any], model_dir: Path) -> None:
    for key, expected in parameters.items():
        algorithm, colon, relative = str(key).partition(":")
        if not colon:
            raise InvalidConfig(f"failed to parse key: {key}")
        if algorithm.lower() != "md5":
            raise InvalidConfig(f"Unsupported checksum algorithm: {algorithm}")
        path = _inside(model_dir, relative)
        try:
            stat = path.stat()
            digest = _md5(str(path), stat.st_size, stat.st_mtime_ns)
        except OSError as exc:
            reason = exc.strerror or str(exc)
            raise InvalidConfig(f"failed to open text file for read {relative}: {reason}") from None
        if digest != str(expected):
            raise InvalidConfig(
                f"Mismatched MD5 hash for file {relative}, expect: {expected}, got: {digest}"
            )


def _inside(model_dir: Path, relative: str) -> Path:
    """``relative`` within ``model_dir``; InvalidConfig for a path that leaves it."""
    parts = PurePosixPath(relative)
    if not relative or parts.is_absolute() or ".." in parts.parts or "\\" in relative:
        raise InvalidConfig(f"checksum agent: '{relative}' is not a file inside the model's folder")
    return model_dir / parts


@functools.lru_cache(maxsize=1024)
def _md5(path: str, size: int, mtime_ns: int) -> str:
    """The file's MD5 (``size`` and ``mtime_ns`` make a changed file a new entry)."""
    del size, mtime_ns
    digest = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as file:
        while chunk := file.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()
