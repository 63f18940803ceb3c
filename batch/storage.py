"""Where a batch job's data lives, for the batch worker: its input (one of the tenant's
uploads in the batch store, or a location the operator allows the tenant) and the tree its
outputs go to (``<output>/<batch id>/``, or the store's ``<tenant>/batches/<batch id>/``).

Every location a client names is checked again here, where it is opened (links followed now,
not when it was submitted): :mod:`sluice.core.batch_jobs.access`. An S3 input is downloaded
once per worker into a scratch directory, within ``SLUICE_MAX_BATCH_INPUT_BYTES``; outputs
are written to scratch files first and then put in place whole. A batch worker removes the
scratch directories of those that were killed when it starts. Errors name the client's own
locations only.
"""

from __future__ import annotations

import fcntl
import shutil
import tempfile
from pathlib import Path
from typing import IO

from sluice.core.batch_jobs import batches as b
from sluice.core.batch_jobs.access import LocationPolicy
from sluice.core.batch_jobs.store import (
    NO_STORE,
    BatchStore,
    S3Clients,
    Tree,
    fetch_s3,
    open_store,
    open_tree,
    split_s3,
)
from sluice.core.errors import InvalidInput
from sluice.core.settings import BatchSettings

_SCRATCH_PREFIX = "sluice-batch-"
_SCRATCH_LOCK = ".lock"


def _scratch_dir() -> tuple[Path, IO[bytes]]:
    """A scratch directory of this process's own, and the open lock file that marks it in
    use while the process lives. The scratch directories of batch workers that died (killed:
    nothing of theirs removed them), whose lock nobody holds, are removed first: each may
    hold a downloaded input of up to SLUICE_MAX_BATCH_INPUT_BYTES."""
    for old in Path(tempfile.gettempdir()).glob(f"{_SCRATCH_PREFIX}*"):
        _remove_abandoned(old)
    path = Path(tempfile.mkdtemp(prefix=_SCRATCH_PREFIX))
    lock = (path / _SCRATCH_LOCK).open("wb")
    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return path, lock


def _remove_abandoned(path: Path) -> None:
    """Remove ``path`` if it is a batch worker's scratch directory whose lock nobody holds
    (one without a lock file, just made or not ours, is left alone)."""
    try:
        with (path / _SCRATCH_LOCK).open("rb") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            shutil.rmtree(path, ignore_errors=True)
    except OSError:  # no lock file, or its owner lives (the lock is held)
        return


class Storage:
    def __init__(self, settings: BatchSettings, scratch: Path | None = None) -> None:
        self.settings = settings
        self.clients = S3Clients(settings)
        self.store = open_store(settings, self.clients)
        self.policy = LocationPolicy.from_settings(settings)
        self._lock: IO[bytes] | None = None
        if scratch is None:
            scratch, self._lock = _scratch_dir()
        self.scratch = scratch

    def need_store(self) -> BatchStore:
        if self.store is None:
            raise InvalidInput(NO_STORE)
        return self.store

    # -- input ---------------------------------------------------------------------------

    def input_file(self, tenant: str, location: str, cache_name: str) -> Path:
        """A local file holding the input (S3: downloaded into the scratch directory once)."""
        target = self.scratch / "inputs" / cache_name
        if target.is_file():
            return target
        limit = self.settings.max_batch_input_bytes
        if b.is_upload_input(location):
            uploads = self.need_store().uploads(tenant)
            return uploads.fetch(b.upload_of(location), target, limit, "input")
        real = self.policy.check(tenant, location, "input")
        if real.startswith("s3://"):
            bucket, key = split_s3(real)
            return fetch_s3(self.clients(), bucket, key, target, limit, "input", location)
        path = Path(real)
        if not path.is_file():
            raise InvalidInput(f"'input': {location} is not a file")
        return path

    # -- output --------------------------------------------------------------------------

    def output_tree(self, tenant: str, batch_id: str, output: str) -> Tree:
        """Where this batch writes: ``<output>/<batch id>/``, or its area of the store."""
        if not output:
            return self.need_store().batch_outputs(tenant, batch_id)
        real = self.policy.check(tenant, output, "output")
        shown = f"{output.rstrip('/')}/{batch_id}"
        return open_tree(real, self.clients, output).child(batch_id, shown)

    def scratch_file(self, name: str) -> Path:
        path = self.scratch / "work" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    def close(self) -> None:
        shutil.rmtree(self.scratch, ignore_errors=True)
        if self._lock is not None:
            self._lock.close()
