"""Where a batch job's data lives: a local path inside the batch root, or ``s3://``.

Every local path a client names is resolved (links followed) and must lie inside
``SLUICE_BATCH_ROOT``: a job can neither read nor write anything else, whatever links the
directory holds. An S3 input is downloaded once per worker into a scratch directory and read
from there; outputs are written to scratch files first and uploaded (S3) or renamed into
place (local), so a reader never sees half a file.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from sluice.errors import InvalidInput
from sluice.settings import BatchSettings


class Storage:
    def __init__(self, settings: BatchSettings, scratch: Path | None = None) -> None:
        self.settings = settings
        self.root = Path(os.path.realpath(settings.batch_root)) if settings.batch_root else None
        self.scratch = scratch or Path(tempfile.mkdtemp(prefix="sluice-batch-"))
        self._s3: Any = None

    # -- local paths ---------------------------------------------------------------------

    def local(self, location: str, field: str) -> Path:
        """The real path of a local location, refused outside the batch root."""
        if self.root is None:
            raise InvalidInput(
                f"'{field}': local paths are not allowed here (no SLUICE_BATCH_ROOT); "
                "use an s3:// URL"
            )
        real = Path(os.path.realpath(location))
        if real != self.root and self.root not in real.parents:
            raise InvalidInput(f"'{field}': {location} is outside the batch root {self.root}")
        return real

    # -- input ---------------------------------------------------------------------------

    def input_file(self, location: str, cache_name: str) -> Path:
        """A local file holding the input (S3: downloaded into the scratch directory once)."""
        if not location.startswith("s3://"):
            path = self.local(location, "input")
            if not path.is_file():
                raise InvalidInput(f"'input': {location} is not a file")
            return path
        target = self.scratch / "inputs" / cache_name
        if target.is_file():
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        bucket, key = _split(location)
        partial = target.with_suffix(".part")
        try:
            self.s3().download_file(bucket, key, str(partial))
        except Exception as exc:  # botocore's errors: not found, denied, unreachable
            raise InvalidInput(f"'input': cannot read {location}: {exc}") from None
        partial.replace(target)
        return target

    # -- output --------------------------------------------------------------------------

    def put(self, output: str, name: str, source: Path) -> str:
        """Move the finished scratch file ``source`` to ``<output>/<name>``; its location."""
        if output.startswith("s3://"):
            bucket, prefix = _split(output.rstrip("/") + "/")
            key = f"{prefix}{name}"
            self.s3().upload_file(str(source), bucket, key)
            source.unlink(missing_ok=True)
            return f"s3://{bucket}/{key}"
        directory = self.local(output, "output")
        directory.mkdir(parents=True, exist_ok=True)
        target = self.local(str(directory / name), "output")
        os.replace(source, target)
        return str(target)

    def get(self, location: str) -> Path:
        """A local file with the content of an output written by :meth:`put`."""
        if not location.startswith("s3://"):
            return self.local(location, "output")
        bucket, key = _split(location)
        target = self.scratch / "parts" / key.replace("/", "_")
        target.parent.mkdir(parents=True, exist_ok=True)
        self.s3().download_file(bucket, key, str(target))
        return target

    def remove(self, location: str) -> None:
        try:
            if location.startswith("s3://"):
                bucket, key = _split(location)
                self.s3().delete_object(Bucket=bucket, Key=key)
            else:
                self.local(location, "output").unlink(missing_ok=True)
        except (OSError, InvalidInput):
            pass

    def scratch_file(self, name: str) -> Path:
        path = self.scratch / "work" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    def close(self) -> None:
        shutil.rmtree(self.scratch, ignore_errors=True)

    def s3(self) -> Any:
        if self._s3 is None:
            try:
                import boto3
                from botocore.config import Config
            except ImportError:
                raise InvalidInput("s3:// locations need boto3: pip install 'sluice[s3]'") from None
            options: dict[str, Any] = {
                "connect_timeout": self.settings.s3_timeout_s,
                "read_timeout": self.settings.s3_timeout_s,
                "retries": {"max_attempts": self.settings.s3_attempts, "mode": "standard"},
            }
            if self.settings.s3_region:
                options["region_name"] = self.settings.s3_region
            self._s3 = boto3.client(
                "s3", endpoint_url=self.settings.s3_endpoint_url or None, config=Config(**options)
            )
        return self._s3


def _split(location: str) -> tuple[str, str]:
    bucket, _, key = location[len("s3://") :].partition("/")
    return bucket, key
