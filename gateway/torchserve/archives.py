"""The archive TorchServe's ``POST /models?url=`` registers, found as TorchServe finds it,
with TorchServe's answers when it cannot be.

``url`` names an entry of the model store (``SLUICE_MODEL_STORE``, TorchServe's
``--model-store``) by its file name, or is a URL the operator allows
(``SLUICE_ALLOWED_MODEL_URLS``: regular expressions, comma-separated, matched against the
whole URL; none by default, where TorchServe allows every URL). The entry may be any of the
store's forms (a .mar, a .tar.gz, a model folder: :mod:`sluice.core.torchserve.forms`); what is
registered is a .mar. The answers: an empty ``url``, a path that climbs (``..``), a URL not
allowed and an entry not in the store are 404 (TorchServe's ModelNotFoundException); a
download that fails (the server answers 404, say) is 400 (its DownloadArchiveException).
A workflow archive (``POST /workflows?url=``) is found the same way in the workflow store
(``SLUICE_WORKFLOW_STORE``, else the model store), with TorchServe's texts and exception
for workflows (WorkflowNotFoundException; an empty ``url``: ``Workflow not found at: ``).
"""

from __future__ import annotations

import asyncio
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

from sluice.core.errors import InvalidInput, NotFound
from sluice.core.torchserve.archives import MarManifest, UnpackLimits
from sluice.core.torchserve.forms import pack
from sluice.core.torchserve.settings import ArchiveSettings, read_archive_settings
from sluice.core.torchserve.workflows import MAX_WAR_BYTES, WorkflowArchive, read_war
from sluice.gateway.torchserve.exception_types import WorkflowNotFound

MAX_REGISTER_BYTES = 256 << 20
"""A registered archive travels to ``sluice up`` in a control command; a larger one is laid
out with ``sluice import-mar`` instead."""
_DOWNLOAD_TIMEOUT_S = 60
"""The longest wait for a connection or the next bytes of a download."""
_DOWNLOAD_DEADLINE_S = 600
"""The longest a whole download takes: a server that drips a byte a minute never passes
the wait for the next bytes."""


@dataclass(frozen=True, slots=True)
class Archive:
    data: bytes
    """The model as a .mar."""
    manifest: MarManifest
    settings: ArchiveSettings
    """Its ``model-config.yaml``."""


def _too_large(url: str) -> InvalidInput:
    return InvalidInput(
        f"'{url}' is larger than {MAX_REGISTER_BYTES >> 20} MiB: lay it out with "
        "`sluice import-mar` instead"
    )


async def find_archive(url: str, store: Path | None, allowed: str) -> Archive:
    """The archive ``url`` names, read and checked."""
    with tempfile.TemporaryDirectory(prefix="sluice-register-") as scratch:
        source = await _fetched(url, store, allowed, Path(scratch), "Model")
        return await asyncio.to_thread(_read, source, Path(scratch) / "model.mar", url)


async def find_workflow(url: str, store: Path | None, allowed: str) -> WorkflowArchive:
    """The workflow archive (.war) ``url`` names, read and checked, as TorchServe's
    ``POST /workflows?url=`` finds it: in the workflow store, or at a URL allowed. Each
    archive it cannot find is TorchServe's ``WorkflowNotFoundException`` (a URL not
    allowed, a relative path and an entry not in the store included), as TorchServe's
    workflow archive raises no other for them."""
    with tempfile.TemporaryDirectory(prefix="sluice-workflow-") as scratch:
        try:
            source = await _fetched(url, store, allowed, Path(scratch), "Workflow")
        except NotFound as missing:
            raise WorkflowNotFound(missing.message) from None
        if not source.is_file():
            raise WorkflowNotFound(f"Workflow not found at: {url}")
        if source.stat().st_size > MAX_WAR_BYTES:
            raise InvalidInput(f"'{url}' is larger than {MAX_WAR_BYTES >> 20} MiB")
        return await asyncio.to_thread(read_war, source)


def archive_of(data: bytes, url: str) -> Archive:
    """A .mar made here (a workflow's function), read and checked as a registered one."""
    with tempfile.TemporaryDirectory(prefix="sluice-register-") as scratch:
        source = Path(scratch) / "made.mar"
        source.write_bytes(data)
        return _read(source, Path(scratch) / "model.mar", url)


async def _fetched(url: str, store: Path | None, allowed: str, scratch: Path, kind: str) -> Path:
    """Where the entry ``url`` names is: in ``store``, or downloaded into ``scratch``
    (``kind``: "Model" or "Workflow", as TorchServe's answers name it)."""
    if not url:
        raise NotFound(_empty_url(store, kind))
    if ".." in url:
        raise NotFound(f"Relative path is not allowed in url: {url}")
    if "://" in url:
        source = scratch / "download"
        await _download(url, allowed, source)
        return source
    return _in_store(url, store, kind)


def _empty_url(store: Path | None, kind: str) -> str:
    """TorchServe's answer to an empty ``url`` (once the store is known to be configured):
    a model's is ``empty url``; a workflow's has no check of its own, so the empty name
    names the store's folder itself, which is no archive (``Workflow not found at: ``)."""
    _configured(store, kind)
    return "empty url" if kind == "Model" else f"{kind} not found at: "


def _configured(store: Path | None, kind: str) -> Path:
    if store is None:
        raise NotFound(
            f"{kind} store has not been configured (SLUICE_{kind.upper()}_STORE): nothing "
            "to register"
        )
    return store


def _in_store(url: str, store: Path | None, kind: str) -> Path:
    """The entry of the store named by the file name ``url`` ends with."""
    store = _configured(store, kind)
    name = url.rstrip("/").rsplit("/", 1)[-1]
    path = Path(store) / name
    where = f"{kind} not found in {kind.lower()} store: {url}"
    if not name or name.startswith(".") or "\\" in name or not _exists(path):
        raise NotFound(where)
    if path.is_symlink() or not (path.is_file() or path.is_dir()):
        raise NotFound(f"{where} (not a file or folder)")
    return path


def _exists(path: Path) -> bool:
    """Whether ``path`` exists; a name the filesystem cannot hold (too long, a NUL) names
    nothing."""
    try:
        return path.exists()
    except (OSError, ValueError):
        return False


def _read(source: Path, target: Path, url: str) -> Archive:
    if source.is_file() and source.stat().st_size > MAX_REGISTER_BYTES:
        raise _too_large(url)
    manifest = pack(source, target, UnpackLimits(total_bytes=MAX_REGISTER_BYTES))
    if target.stat().st_size > MAX_REGISTER_BYTES:
        raise _too_large(url)
    return Archive(target.read_bytes(), manifest, read_archive_settings(target, manifest))


async def _download(url: str, allowed: str, target: Path) -> None:
    patterns = [p.strip() for p in allowed.split(",") if p.strip()]
    if not url.startswith(("http://", "https://")) or not any(
        re.fullmatch(pattern, url) for pattern in patterns
    ):
        raise NotFound(
            f"Given URL {url[:200]} does not match any allowed URL(s) "
            "(SLUICE_ALLOWED_MODEL_URLS); an archive of the model store is named by its "
            "file name"
        )
    import httpx  # (here: importing it costs a gateway's start about a second of CPU)

    failed = InvalidInput(f"Failed to download archive from: {url}")
    size = 0
    try:
        async with (
            asyncio.timeout(_DOWNLOAD_DEADLINE_S),
            httpx.AsyncClient(timeout=_DOWNLOAD_TIMEOUT_S, follow_redirects=False) as client,
            client.stream("GET", url) as response,
        ):
            if response.status_code != 200:
                raise InvalidInput(f"{failed.message} (HTTP {response.status_code})")
            with target.open("wb") as sink:
                async for chunk in response.aiter_bytes():
                    size += len(chunk)
                    if size > MAX_REGISTER_BYTES:
                        raise _too_large(url)
                    sink.write(chunk)
    except httpx.HTTPError as exc:
        raise InvalidInput(f"{failed.message} ({type(exc).__name__})") from None
    except TimeoutError:
        raise InvalidInput(
            f"{failed.message} (not done in {_DOWNLOAD_DEADLINE_S} seconds)"
        ) from None
