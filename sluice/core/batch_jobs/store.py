"""Where batch data lives: the deployment's batch store, and the other places an operator
lets a tenant name, behind one small interface.

A :class:`Tree` is a root (a local directory, or ``s3://bucket/prefix/``) holding files
under relative keys. Writers never leave half a file: a local file is written beside its
place and renamed into it; an S3 object is written with a multipart upload completed only
at the end (aborted otherwise). Local keys are resolved (links followed) and must stay
inside the tree's root.

The batch store (``SLUICE_BATCH_STORE``) is a tree with one area per tenant:
``<tenant>/uploads/<upload id>`` (the files of ``POST /v2/uploads``) and
``<tenant>/batches/<batch id>/`` (the outputs of batch jobs that name no output location).
The gateway and the batch workers both use it; names shown to clients never contain the
store's own location.

Everything here blocks: the gateway calls it through ``asyncio.to_thread``.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import uuid
from abc import ABC, abstractmethod
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sluice.core.errors import InvalidInput, NotFound, PayloadTooLarge
from sluice.core.s3_client import s3_client
from sluice.core.settings import BatchStoreSettings, RepositorySourceSettings

CHUNK_BYTES = 1 << 20
"""Reads and writes go in pieces of this size."""

S3_PART_BYTES = 8 << 20
"""Multipart upload part size (S3 takes parts of 5 MiB and more, but the last)."""

_SEGMENT = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,254}")


def check_key(key: str) -> str:
    """A relative key of safe segments (no ``..``, no leading ``/``), or ValueError."""
    parts = key.split("/")
    if not key or not all(_SEGMENT.fullmatch(p) for p in parts):
        raise ValueError(f"unsafe key {key[:100]!r}")
    return key


class Writer(ABC):
    """A file being written: :meth:`commit` puts it in place, :meth:`abort` leaves nothing.
    Counts the bytes and computes their SHA-256 on the way."""

    def __init__(self) -> None:
        self.bytes = 0
        self._digest = hashlib.sha256()

    def write(self, data: bytes) -> None:
        self._digest.update(data)
        self.bytes += len(data)
        self._write(data)

    def sha256(self) -> str:
        return self._digest.hexdigest()

    @abstractmethod
    def _write(self, data: bytes) -> None: ...

    @abstractmethod
    def commit(self) -> None: ...

    @abstractmethod
    def abort(self) -> None: ...


class Tree(ABC):
    """Files under relative keys of one root."""

    shown: str
    """How the root is named in messages to a client (never the store's own location)."""
    is_local = False

    @abstractmethod
    def child(self, prefix: str, shown: str | None = None) -> Tree:
        """The tree under ``prefix`` (a key)."""

    @abstractmethod
    def writer(self, key: str) -> Writer: ...

    @abstractmethod
    def put_file(self, key: str, source: Path) -> int:
        """Move (local) or upload (S3) the finished file ``source`` to ``key``; its size."""

    @abstractmethod
    def size(self, key: str) -> int | None:
        """The size of ``key``; None when there is no such file."""

    @abstractmethod
    def local_path(self, key: str) -> Path | None:
        """A local tree's real path of ``key`` (None on S3)."""

    @abstractmethod
    def fetch(self, key: str, target: Path, max_bytes: int, field: str) -> Path:
        """A local file with the content of ``key`` (downloaded into ``target`` from S3,
        refused past ``max_bytes``, checked before and while downloading)."""

    @abstractmethod
    def read_chunks(self, key: str, limit: int) -> Iterator[bytes]:
        """The first ``limit`` bytes of ``key``, in pieces; NotFound when it is missing."""

    @abstractmethod
    def delete(self, key: str) -> None: ...

    @abstractmethod
    def discard(self, key: str) -> None:
        """``key`` and what an unfinished write of it left (a writer's process that died:
        its partial file, or on S3 its multipart upload, which no listing shows)."""

    @abstractmethod
    def delete_tree(self) -> None:
        """Every file of this tree (and its unfinished writes)."""

    def join(self, key: str) -> str:
        """How ``key`` is named to a client."""
        if self.shown.endswith(":"):
            return f"{self.shown}{key}"
        return f"{self.shown.rstrip('/')}/{key}"


# -- local ---------------------------------------------------------------------------------


class LocalTree(Tree):
    is_local = True

    def __init__(self, root: Path, shown: str) -> None:
        self.root = Path(os.path.realpath(root))
        self.shown = shown

    def path(self, key: str) -> Path:
        """The real path of ``key``, refused (ValueError) outside the root."""
        real = Path(os.path.realpath(self.root / check_key(key)))
        if self.root not in real.parents:
            raise ValueError(f"{key[:100]!r} leaves its tree")
        return real

    def child(self, prefix: str, shown: str | None = None) -> Tree:
        return LocalTree(self.root / check_key(prefix), shown or self.join(prefix))

    def writer(self, key: str) -> Writer:
        target = self.path(key)
        target.parent.mkdir(parents=True, exist_ok=True)
        return _LocalWriter(target)

    def put_file(self, key: str, source: Path) -> int:
        target = self.path(key)
        target.parent.mkdir(parents=True, exist_ok=True)
        size = source.stat().st_size
        try:
            os.replace(source, target)
        except OSError:  # another file system: copy beside it, then rename
            partial = target.with_name(f".{target.name}.{uuid.uuid4().hex[:8]}.part")
            shutil.copyfile(source, partial)
            os.replace(partial, target)
            source.unlink(missing_ok=True)
        return size

    def size(self, key: str) -> int | None:
        try:
            path = self.path(key)
            return path.stat().st_size if path.is_file() else None
        except (OSError, ValueError):
            return None

    def local_path(self, key: str) -> Path | None:
        return self.path(key)

    def fetch(self, key: str, target: Path, max_bytes: int, field: str) -> Path:
        path = self.path(key)
        if not path.is_file():
            raise InvalidInput(f"'{field}': {self.join(key)} is not a file")
        return path

    def read_chunks(self, key: str, limit: int) -> Iterator[bytes]:
        try:
            stream = self.path(key).open("rb")
        except (OSError, ValueError):
            raise NotFound(f"no file {self.join(key)}") from None
        return _file_chunks(stream, limit)

    def delete(self, key: str) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.path(key).unlink(missing_ok=True)

    def discard(self, key: str) -> None:
        self.delete(key)
        with contextlib.suppress(OSError, ValueError):
            target = self.path(key)
            for partial in target.parent.glob(f".{target.name}.*.part"):
                partial.unlink(missing_ok=True)

    def delete_tree(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def _file_chunks(stream: Any, limit: int) -> Iterator[bytes]:
    with stream:
        left = limit
        while left > 0:
            data = stream.read(min(CHUNK_BYTES, left))
            if not data:
                return
            left -= len(data)
            yield data


class _LocalWriter(Writer):
    def __init__(self, target: Path) -> None:
        super().__init__()
        self.target = target
        self.partial = target.with_name(f".{target.name}.{uuid.uuid4().hex[:8]}.part")
        self.stream = self.partial.open("wb")

    def _write(self, data: bytes) -> None:
        self.stream.write(data)

    def commit(self) -> None:
        self.stream.close()
        os.replace(self.partial, self.target)

    def abort(self) -> None:
        self.stream.close()
        self.partial.unlink(missing_ok=True)


# -- S3 ------------------------------------------------------------------------------------


def split_s3(location: str) -> tuple[str, str]:
    """``s3://bucket/key`` -> (bucket, key)."""
    bucket, _, key = location[len("s3://") :].partition("/")
    return bucket, key


class S3Tree(Tree):
    def __init__(self, client: Any, bucket: str, prefix: str, shown: str) -> None:
        self.client, self.bucket = client, bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self.shown = shown

    def key(self, key: str) -> str:
        return self.prefix + check_key(key)

    def child(self, prefix: str, shown: str | None = None) -> Tree:
        return S3Tree(self.client, self.bucket, self.key(prefix), shown or self.join(prefix))

    def writer(self, key: str) -> Writer:
        return _S3Writer(self.client, self.bucket, self.key(key))

    def put_file(self, key: str, source: Path) -> int:
        size = source.stat().st_size
        self.client.upload_file(str(source), self.bucket, self.key(key))
        source.unlink(missing_ok=True)
        return size

    def size(self, key: str) -> int | None:
        try:
            head = self.client.head_object(Bucket=self.bucket, Key=self.key(key))
        except Exception:  # botocore's errors: missing, denied, unreachable
            return None
        return int(head["ContentLength"])

    def local_path(self, key: str) -> Path | None:
        return None

    def fetch(self, key: str, target: Path, max_bytes: int, field: str) -> Path:
        return fetch_s3(
            self.client, self.bucket, self.key(key), target, max_bytes, field, self.join(key)
        )

    def read_chunks(self, key: str, limit: int) -> Iterator[bytes]:
        try:
            body = self.client.get_object(Bucket=self.bucket, Key=self.key(key))["Body"]
        except Exception:
            raise NotFound(f"no file {self.join(key)}") from None
        return _body_chunks(body, limit)

    def delete(self, key: str) -> None:
        with contextlib.suppress(Exception):
            self.client.delete_object(Bucket=self.bucket, Key=self.key(key))

    def discard(self, key: str) -> None:
        self.delete(key)
        self._abort_uploads(self.key(key), exact=True)

    def delete_tree(self) -> None:
        try:
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=self.prefix
            )
            for page in pages:
                objects = [{"Key": o["Key"]} for o in page.get("Contents", [])]
                if objects:
                    self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": objects})
        except Exception:
            pass
        self._abort_uploads(self.prefix, exact=False)

    def _abort_uploads(self, prefix: str, exact: bool) -> None:
        """Abort the multipart uploads under ``prefix`` (``exact``: of that key only): the
        parts a writer that died had sent, kept (and billed) by S3 until aborted."""
        try:
            pages = self.client.get_paginator("list_multipart_uploads").paginate(
                Bucket=self.bucket, Prefix=prefix
            )
            for page in pages:
                for started in page.get("Uploads", []):
                    if exact and started["Key"] != prefix:
                        continue
                    self.client.abort_multipart_upload(
                        Bucket=self.bucket, Key=started["Key"], UploadId=started["UploadId"]
                    )
        except Exception:  # botocore's errors: best effort, as every deletion here
            pass


def fetch_s3(
    client: Any, bucket: str, key: str, target: Path, max_bytes: int, field: str, shown: str
) -> Path:
    """Download ``s3://bucket/key`` into ``target``, refused past ``max_bytes`` (checked with
    a HEAD first, and again while downloading). Errors name ``shown`` only."""
    try:
        head = client.head_object(Bucket=bucket, Key=key)
    except Exception:  # botocore's errors: missing, denied, unreachable (all read the same)
        raise InvalidInput(f"'{field}': cannot read {shown}") from None
    if int(head["ContentLength"]) > max_bytes:
        raise PayloadTooLarge(
            f"'{field}': {shown} has {head['ContentLength']} bytes, more than "
            f"SLUICE_MAX_BATCH_INPUT_BYTES ({max_bytes})"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f"{target.name}.{uuid.uuid4().hex[:8]}.part")
    try:
        body = client.get_object(Bucket=bucket, Key=key)["Body"]
        received = 0
        with partial.open("wb") as stream:
            for data in body.iter_chunks(CHUNK_BYTES):
                received += len(data)
                if received > max_bytes:  # it grew since the HEAD
                    raise PayloadTooLarge(
                        f"'{field}': {shown} has more than SLUICE_MAX_BATCH_INPUT_BYTES "
                        f"({max_bytes}) bytes"
                    )
                stream.write(data)
        partial.replace(target)
    except PayloadTooLarge:
        partial.unlink(missing_ok=True)
        raise
    except Exception:
        partial.unlink(missing_ok=True)
        raise InvalidInput(f"'{field}': cannot read {shown}") from None
    return target


def _body_chunks(body: Any, limit: int) -> Iterator[bytes]:
    try:
        left = limit
        for data in body.iter_chunks(CHUNK_BYTES):
            data = data[:left]
            left -= len(data)
            if data:
                yield data
            if left <= 0:
                return
    finally:
        body.close()


class _S3Writer(Writer):
    """A multipart upload, a part each :data:`S3_PART_BYTES`; a small file is one PUT."""

    def __init__(self, client: Any, bucket: str, key: str) -> None:
        super().__init__()
        self.client, self.bucket, self.key = client, bucket, key
        self.buffer = bytearray()
        self.upload_id: str | None = None
        self.parts: list[dict[str, Any]] = []

    def _write(self, data: bytes) -> None:
        self.buffer += data
        while len(self.buffer) >= S3_PART_BYTES:
            self._part(bytes(self.buffer[:S3_PART_BYTES]))
            del self.buffer[:S3_PART_BYTES]

    def _part(self, data: bytes) -> None:
        if self.upload_id is None:
            started = self.client.create_multipart_upload(Bucket=self.bucket, Key=self.key)
            self.upload_id = started["UploadId"]
        number = len(self.parts) + 1
        answer = self.client.upload_part(
            Bucket=self.bucket, Key=self.key, UploadId=self.upload_id, PartNumber=number, Body=data
        )
        self.parts.append({"PartNumber": number, "ETag": answer["ETag"]})

    def commit(self) -> None:
        if self.upload_id is None:
            self.client.put_object(Bucket=self.bucket, Key=self.key, Body=bytes(self.buffer))
            return
        if self.buffer:
            self._part(bytes(self.buffer))
        self.client.complete_multipart_upload(
            Bucket=self.bucket,
            Key=self.key,
            UploadId=self.upload_id,
            MultipartUpload={"Parts": self.parts},
        )

    def abort(self) -> None:
        self.buffer = bytearray()
        if self.upload_id is not None:
            with contextlib.suppress(Exception):
                self.client.abort_multipart_upload(
                    Bucket=self.bucket, Key=self.key, UploadId=self.upload_id
                )


# -- opening -------------------------------------------------------------------------------


class S3Clients:
    """One boto3 client per process, made when first needed."""

    def __init__(self, settings: RepositorySourceSettings) -> None:
        self.settings = settings
        self._client: Any = None

    def __call__(self) -> Any:
        if self._client is None:
            self._client = s3_client(self.settings)
        return self._client


def open_tree(location: str, clients: S3Clients, shown: str | None = None) -> Tree:
    """The tree rooted at ``location`` (a local directory or ``s3://bucket/prefix``)."""
    if location.startswith("s3://"):
        bucket, prefix = split_s3(location)
        return S3Tree(clients(), bucket, prefix, shown or location)
    return LocalTree(Path(location), shown or location)


class BatchStore:
    """The deployment's batch store: one area per tenant."""

    def __init__(self, location: str, clients: S3Clients) -> None:
        self.location = location
        self._clients = clients
        self._tree: Tree | None = None

    @property
    def tree(self) -> Tree:
        if self._tree is None:
            self._tree = open_tree(self.location, self._clients, "store")
        return self._tree

    @property
    def is_local(self) -> bool:
        return not self.location.startswith("s3://")

    def uploads(self, tenant: str) -> Tree:
        return self.tree.child(f"{tenant}/uploads", "upload:")

    def batch_outputs(self, tenant: str, batch_id: str) -> Tree:
        """Where a batch job that names no output location writes (shown as its outputs
        route)."""
        return self.tree.child(f"{tenant}/batches/{batch_id}", f"/v2/batches/{batch_id}/outputs")


def open_store(settings: BatchStoreSettings, clients: S3Clients | None = None) -> BatchStore | None:
    """The batch store ``SLUICE_BATCH_STORE`` names; None without one."""
    if not settings.batch_store:
        return None
    location = settings.batch_store
    if not location.startswith("s3://"):
        location = os.path.abspath(location)
    return BatchStore(location, clients or S3Clients(settings))


NO_STORE = "no batch store: the operator sets SLUICE_BATCH_STORE (a directory or s3:// URL)"
