"""Triton's repository agents that a model's configuration names (``model_repository_agents``).

Triton runs each named agent before it loads the model, and the load fails when an agent
does, or when the agent is not installed. Sluice carries out Triton's ``checksum`` agent
itself: each of its parameters is ``<algorithm>:<file relative to the model's folder>`` ->
the file's expected digest (MD5, the one algorithm that agent knows), and a file that
does not match makes the model unavailable with Triton's text. Any other agent makes it
unavailable too, naming the agent, rather than serving what the agent would have checked
or changed.

A key's path stays inside the model's folder: an absolute path or one that climbs out of
it (``..``) is refused, and so is one that names no regular file (a FIFO would block the
read, a device read without end). Digests are computed when a model is read (a repository
scan, a load, a worker's start) and remembered per file, inode, size, modification and
status change times, so a poll of an unchanged repository does not read the files again,
while any change to a file (its times set back, a copy renamed over it) is read again.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
import threading
import time
from collections.abc import Mapping
from pathlib import Path, PurePosixPath
from typing import IO, Any

from sluice.core.config import ModelConfig
from sluice.core.errors import InvalidConfig

CHECKSUM_AGENT = "checksum"
_CHUNK = 1 << 20
_REMEMBERED_MAX = 1024

_SETTLED_NS = 2_000_000_000
"""A digest is remembered only for a file whose status last changed this long before:
file systems keep times in coarse steps, and a file changed twice within one step keeps
the same times, so the digest of what it held first would be taken for the second."""

_clock_ns = time.time_ns
"""Wall-clock nanoseconds, as file times are (a test's own clock)."""

_FileKey = tuple[str, int, int, int, int, int]
_remembered: dict[_FileKey, str] = {}
_remembered_lock = threading.Lock()


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
            digest = _md5(path)
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
    if (
        not relative
        or parts.is_absolute()
        or ".." in parts.parts
        or "\\" in relative
        or "\0" in relative
    ):
        raise InvalidConfig(f"checksum agent: '{relative}' is not a file inside the model's folder")
    return model_dir / parts


def _md5(path: Path) -> str:
    """The MD5 of the regular file ``path`` (OSError for another kind: it is opened without
    blocking, so a FIFO is refused rather than waited on), remembered once it has settled."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as file:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise OSError(errno.EINVAL, "not a regular file")
        key = (
            str(path),
            info.st_dev,
            info.st_ino,
            info.st_size,
            info.st_mtime_ns,
            info.st_ctime_ns,
        )
        with _remembered_lock:
            digest = _remembered.get(key)
        if digest is None:
            digest = _read_md5(file)
            if _clock_ns() - info.st_ctime_ns >= _SETTLED_NS:
                _remember(key, digest)
    return digest


def _remember(key: _FileKey, digest: str) -> None:
    with _remembered_lock:
        if len(_remembered) >= _REMEMBERED_MAX:
            del _remembered[next(iter(_remembered))]
        _remembered[key] = digest


def _read_md5(file: IO[bytes]) -> str:
    digest = hashlib.md5(usedforsecurity=False)
    while chunk := file.read(_CHUNK):
        digest.update(chunk)
    return digest.hexdigest()
