"""Model repositories in S3 or an S3-compatible store (MinIO, Ceph, moto), through boto3.

Credentials come from boto3's standard chain (environment, profile, instance role);
``SLUICE_S3_ENDPOINT_URL`` points at another store. Each request has a connect and read
timeout and boto3's standard retries; a download that breaks off mid-way is started again,
up to ``SLUICE_S3_ATTEMPTS`` times. Every download is conditional on the ETag listed
(``If-Match``), so an object replaced between listing and download is not mixed in.
"""

from __future__ import annotations

import hashlib
import logging
import re
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol

from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    ConnectTimeoutError,
    EndpointConnectionError,
    NoCredentialsError,
    ReadTimeoutError,
)

from sluice.core.s3_client import s3_client
from sluice.core.settings import RepositorySourceSettings
from sluice.scheduler.repository.cache import SnapshotCache
from sluice.scheduler.repository.listing import MAX_MANIFEST_BYTES, Limits, RemoteObject, assemble
from sluice.scheduler.repository.sources import (
    Entry,
    Listing,
    Materialised,
    RepositorySource,
    SourceError,
    key_problem,
    show,
)

log = logging.getLogger("sluice.sources")

_CHUNK = 1 << 20
# Permissive on purpose (other stores allow upper case and '_'); never a path separator.
_BUCKET = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{1,254}")
_CHANGED = {"PreconditionFailed", "412", "NoSuchKey", "404"}
_DENIED = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "403"}
_Objects = tuple[list[RemoteObject], list[str]]
"""Objects under the prefix, and messages about keys refused outside it."""


class _Writer(Protocol):
    def write(self, data: bytes) -> None: ...

    def reset(self) -> None: ...


class _Buffer:
    """A small object (a manifest) read into memory, refusing more than it listed."""

    def __init__(self, limit: int, where: str) -> None:
        self.limit, self.where = limit, where
        self.data = bytearray()

    def write(self, data: bytes) -> None:
        if len(self.data) + len(data) > self.limit:
            raise SourceError(f"{self.where}: the store sends more than the {self.limit} bytes")
        self.data += data

    def reset(self) -> None:
        self.data.clear()


def parse_s3_url(location: str) -> tuple[str, str]:
    """``s3://bucket/some/prefix`` as ``("bucket", "some/prefix/")`` (prefix may be empty)."""
    bucket, _, prefix = location.removeprefix("s3://").partition("/")
    if not _BUCKET.fullmatch(bucket):
        raise SourceError(f"model repository {show(location)}: {show(bucket)} is no bucket name")
    prefix = prefix.strip("/")
    if prefix:
        problem = key_problem(prefix)
        if problem is not None:
            raise SourceError(f"model repository {show(location)}: its prefix: {problem}")
        prefix += "/"
    return bucket, prefix


class S3Source(RepositorySource):
    def __init__(
        self, location: str, settings: RepositorySourceSettings, client: Any = None
    ) -> None:
        self.bucket, self.prefix = parse_s3_url(location)
        self.location = f"s3://{self.bucket}/{self.prefix}"
        digest = hashlib.sha256(self.location.encode()).hexdigest()[:12]
        cache_root = Path(settings.repository_cache_dir) / f"s3-{self.bucket}-{digest}"
        self.cache = SnapshotCache(cache_root)
        self.limits = Limits(settings.s3_max_object_bytes, settings.s3_max_version_bytes)
        self.max_objects = settings.s3_max_objects
        self.attempts = settings.s3_attempts
        self.timeout_s = settings.s3_timeout_s
        self.client = client if client is not None else s3_client(settings)
        self._manifests: dict[tuple[str, str], bytes] = {}

    def url(self, path: str) -> str:
        """The full address of a path relative to the repository prefix."""
        return f"s3://{self.bucket}/{self.prefix}{path}"

    def list(self) -> Listing:
        objects, ignored = self._objects()
        listing = assemble(objects, self._read_manifest, self.limits, self.url)
        listed = {(obj.path, obj.token) for obj in objects}
        self._manifests = {k: v for k, v in self._manifests.items() if k in listed}
        return replace(listing, ignored=(*ignored, *listing.ignored))

    def served(self) -> Listing:
        return self.cache.served()

    def materialise(self, listing: Listing) -> Materialised:
        return self.cache.sync(listing, self._fetch, self.url)

    def _objects(self) -> _Objects:
        objects: list[RemoteObject] = []
        ignored: list[str] = []
        what = f"listing {self.location}"
        try:
            paginator = self.client.get_paginator("list_objects_v2")
            for page in paginator.paginate(Bucket=self.bucket, Prefix=self.prefix):
                for item in page.get("Contents") or []:
                    if len(objects) + len(ignored) >= self.max_objects:
                        raise SourceError(
                            f"{what}: more than {self.max_objects} objects under the prefix "
                            "(SLUICE_S3_MAX_OBJECTS)"
                        )
                    key, size = item.get("Key"), item.get("Size")
                    if not isinstance(key, str) or type(size) is not int or size < 0:
                        raise SourceError(f"{what}: the store sent a malformed entry")
                    if not key.startswith(self.prefix):
                        ignored.append(
                            f"refused key {show(key)}: it is outside the prefix {show(self.prefix)}"
                        )
                        continue
                    path = key[len(self.prefix) :]
                    if path or size:
                        token = item.get("ETag") or f"{item.get('LastModified')}:{size}"
                        objects.append(RemoteObject(path, size, str(token)))
        except (BotoCoreError, ClientError) as exc:
            raise self._explain(exc, what) from None
        return objects, ignored

    def _read_manifest(self, obj: RemoteObject) -> bytes:
        cached = self._manifests.get((obj.path, obj.token))
        if cached is None:
            buffer = _Buffer(min(obj.size, MAX_MANIFEST_BYTES), show(self.url(obj.path)))
            self._get(self.prefix + obj.path, obj.token, obj.size, buffer)
            cached = self._manifests[(obj.path, obj.token)] = bytes(buffer.data)
        return cached

    def _fetch(self, model: str, entry: Entry, sink: _Writer) -> None:
        self._get(f"{self.prefix}{model}/{entry.path}", entry.token, entry.size, sink)

    def _get(self, key: str, token: str, size: int, out: _Writer) -> None:
        """Write one object into ``out``, starting over when the transfer breaks off."""
        where = show(f"s3://{self.bucket}/{key}")
        request: dict[str, Any] = {"Bucket": self.bucket, "Key": key}
        if token.startswith('"'):  # an ETag
            request["IfMatch"] = token
        for attempt in range(1, self.attempts + 1):
            out.reset()
            try:
                response = self.client.get_object(**request)
            except (BotoCoreError, ClientError) as exc:  # boto3 has retried already
                raise self._explain(exc, where) from None
            etag, length = response.get("ETag"), response.get("ContentLength")
            if "IfMatch" in request and isinstance(etag, str) and etag != token:
                raise SourceError(f"{where} changed since it was listed; taken at the next poll")
            if isinstance(length, int) and length != size:
                raise SourceError(f"{where}: the store sends {length} bytes, it listed {size}")
            body = response["Body"]
            try:
                while chunk := body.read(_CHUNK):
                    out.write(chunk)
                return
            except (BotoCoreError, OSError) as exc:
                if attempt == self.attempts:
                    raise SourceError(
                        f"{where}: the download broke off {attempt} time(s), last: {exc}"
                    ) from None
                log.warning("%s: the download broke off (%s); starting it again", where, exc)
                time.sleep(min(5.0, 0.25 * 2 ** (attempt - 1)))
            finally:
                body.close()

    def _explain(self, exc: BaseException, what: str) -> SourceError:
        """A boto3 error as one line saying what failed and what to check."""
        if isinstance(exc, ClientError):
            error = exc.response.get("Error", {})
            code, message = str(error.get("Code", "")), error.get("Message") or str(exc)
            if code in _CHANGED:
                return SourceError(f"{what} changed or was removed since it was listed")
            if code == "NoSuchBucket":
                return SourceError(f"{what}: the bucket '{self.bucket}' does not exist")
            if code in _DENIED:
                return SourceError(
                    f"{what}: access denied ({code}: {message}); credentials come from the "
                    "standard AWS chain (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, "
                    "AWS_PROFILE, an instance role)"
                )
            return SourceError(f"{what}: {code}: {message}")
        if isinstance(exc, NoCredentialsError):
            return SourceError(
                f"{what}: no AWS credentials (set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
                "or AWS_PROFILE, or run with an instance role)"
            )
        if isinstance(exc, ConnectTimeoutError | ReadTimeoutError):
            return SourceError(
                f"{what}: no answer from the store within {self.timeout_s:g} s "
                f"({self.attempts} attempt(s), SLUICE_S3_TIMEOUT_S / SLUICE_S3_ATTEMPTS): {exc}"
            )
        if isinstance(exc, EndpointConnectionError):
            return SourceError(f"{what}: cannot reach the store: {exc}")
        return SourceError(f"{what}: {exc}")
