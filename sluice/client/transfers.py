"""Files between a laptop and the server: uploads streamed from disk, batch outputs streamed
to disk. Memory stays bounded by one chunk either way.

An upload's sha256 is computed in a first pass over the file, before anything is sent: the
server reads it from a header, and headers precede the body. The second pass streams the
file with its size as ``Content-Length`` and stops with an error if the file changed size
in between (a changed content is caught by the server's checksum).

A download is written beside its final name under a hidden temporary one
(``.<name>.<random>.partial``), checked (size, and sha256 where the server's listing gives
one) and renamed into place only when whole: no half file ever lies under the final name.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
import secrets
import stat
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, NoReturn

from sluice.client.errors import MalformedResponse

ProgressCallback = Callable[[int, int | None], None]
"""Called with the bytes done so far and the total (None when unknown). The async client
calls it from a worker thread while it hashes a file."""

CHUNK_BYTES = 1 << 20
SHA256_HEADER = "Sluice-Content-SHA256"
UPLOAD_PREFIX = "upload:"

_UNSAFE_NAME_CHARACTERS = re.compile(r"[^A-Za-z0-9._-]")
_OUTPUT_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,254}")
_SHA256 = re.compile(r"[0-9a-f]{64}")


# ------------------------------------------------------------------------- local paths


def input_file(path: str | os.PathLike[str]) -> Path:
    """The local file to upload, checked: :class:`FileNotFoundError`,
    :class:`IsADirectoryError` or :class:`PermissionError`, each naming the path."""
    file = Path(path)
    try:
        info = file.stat()
    except FileNotFoundError:
        raise FileNotFoundError(f"{file}: no such file") from None
    except OSError as exc:
        raise OSError(f"{file}: {exc.strerror or exc}") from None
    if stat.S_ISDIR(info.st_mode):
        raise IsADirectoryError(
            f"{file} is a folder: give one file (.npy, .npz, .parquet or .jsonl)"
        )
    if not stat.S_ISREG(info.st_mode):
        raise OSError(f"{file} is not a regular file")
    if not os.access(file, os.R_OK):
        raise PermissionError(f"{file}: not readable")
    return file


def output_directory(path: str | os.PathLike[str]) -> Path:
    """A folder downloads may go to: an existing folder, or one that can be created (its
    nearest existing parent is a writable folder). Creates nothing;
    :class:`NotADirectoryError` or :class:`PermissionError` naming the path otherwise."""
    folder = Path(path)
    probe = folder.absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        where = "" if probe == folder.absolute() else f" ({probe} is)"
        raise NotADirectoryError(f"{folder} is a file, not a folder{where}")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise PermissionError(f"{folder}: {probe} is not writable")
    return folder


def upload_name(path: Path) -> str:
    """The name an upload is given by default: the file's own, with characters the server
    does not take in a name replaced (the name only tells the format, by its extension)."""
    name = _UNSAFE_NAME_CHARACTERS.sub("_", path.name).lstrip(".")
    return name or "upload"


def output_path(directory: Path, name: str) -> Path:
    """Where the output file ``name`` (as the server lists it) goes in ``directory``. The
    name is the server's text: a plain file name only (no folder, no ``..``, not hidden)."""
    if not _OUTPUT_NAME.fullmatch(name):
        raise MalformedResponse(
            f"malformed response: the server lists an output named {name[:100]!r}, "
            "not a plain file name; refused"
        )
    return directory / name


# ---------------------------------------------------------------------------- uploads


@dataclass(frozen=True, slots=True)
class UploadSource:
    """A local file to send as a request's body, as it was when hashed."""

    path: Path
    size: int
    sha256: str
    progress: ProgressCallback | None = None


def hash_file(path: Path, progress: ProgressCallback | None = None) -> UploadSource:
    """The first pass: the file's size and sha256, read in chunks."""
    digest = hashlib.sha256()
    done = 0
    with path.open("rb") as handle:
        total = os.fstat(handle.fileno()).st_size
        if progress is not None:
            progress(0, total)
        while chunk := handle.read(CHUNK_BYTES):
            digest.update(chunk)
            done += len(chunk)
            if progress is not None:
                progress(done, total)
    return UploadSource(path, done, digest.hexdigest())


class _BodyCounter:
    """Counts the bytes of an upload's body as it is read; refuses a file that changed
    size since it was hashed (its Content-Length would be a lie)."""

    def __init__(self, source: UploadSource) -> None:
        self.source = source
        self.done = 0

    def take(self, chunk: bytes, beyond: bytes) -> bytes:
        """``chunk`` once counted; ``beyond``: what the file has past the end, read before
        the last chunk is sent, so the server never gets a whole body of a changed file."""
        self.done += len(chunk)
        if not chunk or beyond or self.done > self.source.size:
            self.changed()
        if self.source.progress is not None:
            self.source.progress(self.done, self.source.size)
        return chunk

    def changed(self) -> NoReturn:
        raise OSError(
            f"{self.source.path} changed while it was uploaded "
            f"({self.source.size} bytes when hashed); upload it again"
        )

    def started(self) -> None:
        if self.source.progress is not None:
            self.source.progress(0, self.source.size)


def read_chunks(source: UploadSource) -> Iterator[bytes]:
    """The file's bytes, chunk by chunk (the body of a blocking upload)."""
    counter = _BodyCounter(source)
    counter.started()
    with source.path.open("rb") as handle:
        while counter.done < source.size:
            chunk = handle.read(min(CHUNK_BYTES, source.size - counter.done))
            last = counter.done + len(chunk) == source.size
            yield counter.take(chunk, handle.read(1) if last else b"")


async def aread_chunks(source: UploadSource) -> AsyncIterator[bytes]:
    """The file's bytes, each chunk read in a worker thread (the body of an async upload)."""
    counter = _BodyCounter(source)
    counter.started()
    handle = await asyncio.to_thread(source.path.open, "rb")
    try:
        while counter.done < source.size:
            wanted = min(CHUNK_BYTES, source.size - counter.done)
            chunk = await asyncio.to_thread(handle.read, wanted)
            last = counter.done + len(chunk) == source.size
            beyond = await asyncio.to_thread(handle.read, 1) if last else b""
            yield counter.take(chunk, beyond)
    finally:
        await asyncio.to_thread(handle.close)


def upload_headers(source: UploadSource) -> dict[str, str]:
    return {
        "Content-Type": "application/octet-stream",
        "Content-Length": str(source.size),
        SHA256_HEADER: source.sha256,
    }


def checked_upload(document: dict[str, Any], source: UploadSource) -> dict[str, Any]:
    """The server's record of an upload, which must say it got the file that was sent."""
    upload_id = document.get("id")
    if not isinstance(upload_id, str) or not upload_id:
        raise MalformedResponse("malformed response: the upload's answer has no 'id'")
    if (
        document.get("sha256", source.sha256) != source.sha256
        or document.get("bytes", source.size) != source.size
    ):
        raise MalformedResponse(
            f"malformed response: the server stored upload {upload_id} with another size or "
            f"sha256 than {source.path} has"
        )
    return document


# -------------------------------------------------------------------------- downloads


def checked_output_files(document: dict[str, Any]) -> list[dict[str, Any]]:
    """The ``files`` of a batch's output listing: each a ``name`` (a plain relative name),
    ``bytes`` and, optionally, ``sha256``."""
    files = document.get("files")
    if not isinstance(files, list):
        raise MalformedResponse("malformed response: the outputs' listing has no 'files' list")
    for item in files:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise MalformedResponse("malformed response: an output file without a 'name'")
        output_path(Path("."), item["name"])
        size = item.get("bytes")
        if size is not None and (not isinstance(size, int) or size < 0):
            raise MalformedResponse(f"malformed response: output {item['name']!r}: bad 'bytes'")
        digest = item.get("sha256")
        if digest is not None and (not isinstance(digest, str) or not _SHA256.fullmatch(digest)):
            raise MalformedResponse(f"malformed response: output {item['name']!r}: bad 'sha256'")
    return files


class PartialFile:
    """A download in progress: written to a hidden temporary file beside ``final``, hashed
    and counted as it goes; :meth:`commit` checks it and renames it into place,
    :meth:`discard` removes it."""

    def __init__(self, final: Path, size: int | None = None, sha256: str | None = None) -> None:
        self.final = final
        self.size = size
        self.sha256 = sha256
        self.written = 0
        self._digest = hashlib.sha256()
        self._temporary: Path | None = None
        self._handle: IO[bytes] | None = None

    def open(self) -> None:
        self.final.parent.mkdir(parents=True, exist_ok=True)
        self.written = 0
        self._digest = hashlib.sha256()
        temporary = self.final.with_name(f".{self.final.name}.{secrets.token_hex(6)}.partial")
        # O_EXCL: never someone else's file; mode 0o666 less the umask, as a plain open.
        descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        self._temporary = temporary
        self._handle = os.fdopen(descriptor, "wb")

    def write(self, chunk: bytes) -> None:
        assert self._handle is not None
        self.written += len(chunk)
        if self.size is not None and self.written > self.size:
            raise MalformedResponse(
                f"malformed response: output {self.final.name} is longer than the "
                f"{self.size} bytes listed"
            )
        self._digest.update(chunk)
        self._handle.write(chunk)

    def commit(self) -> Path:
        assert self._handle is not None and self._temporary is not None
        self._handle.flush()
        os.fsync(self._handle.fileno())
        self._handle.close()
        self._handle = None
        if self.size is not None and self.written != self.size:
            raise MalformedResponse(
                f"malformed response: output {self.final.name} has {self.written} bytes, "
                f"the listing said {self.size}"
            )
        if self.sha256 is not None and self._digest.hexdigest() != self.sha256:
            raise MalformedResponse(
                f"output {self.final.name}: its sha256 differs from the server's listing "
                "(corrupted on the way); download it again"
            )
        os.replace(self._temporary, self.final)
        self._temporary = None
        return self.final

    def discard(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None
        if self._temporary is not None:
            self._temporary.unlink(missing_ok=True)
            self._temporary = None


class CombinedProgress:
    """One progress over several files in a row: each file's own (done, total) reported
    as the bytes of every file so far, against the listing's total."""

    def __init__(self, files: list[dict[str, Any]], progress: ProgressCallback | None) -> None:
        sizes = [item.get("bytes") for item in files]
        self.total = None if None in sizes else sum(size or 0 for size in sizes)
        self.progress = progress
        self.before = 0

    def start(self) -> None:
        if self.progress is not None:
            self.progress(0, self.total)

    def for_file(self) -> ProgressCallback | None:
        if self.progress is None:
            return None
        report, before, total = self.progress, self.before, self.total

        def on_file(done: int, _total: int | None) -> None:
            report(before + done, total)

        return on_file

    def file_done(self, path: Path) -> None:
        self.before += path.stat().st_size


def content_length(response: Any) -> int | None:
    """The answer's ``Content-Length``, when it sent a valid one."""
    value = response.headers.get("content-length")
    return int(value) if value is not None and value.isdigit() else None
