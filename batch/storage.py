"""Where a batch job's data lives, for the batch worker: its input (one of the tenant's
uploads in the batch store, or a location the operator allows the tenant) and the tree its
outputs go to (``<output>/<batch id>/``, or the store's ``<tenant>/batches/<batch id>/``).

Every location a client names is checked again here, where it is opened (links followed now,
not when it was submitted): :mod:`sluice.core.batch_jobs.access`. An S3 input is downloaded
once per worker into a scratch directory, within ``SLUICE_MAX_BATCH_INPUT_BYTES``; outputs
are written to scratch files first and then put in place whole. Errors name the client's own
locations only.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

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


class Storage:
    def __init__(self, settings: BatchSettings, scratch: Path | None = None) -> None:
        self.settings = settings
        self.clients = S3Clients(settings)
        self.store = open_store(settings, self.clients)
        self.policy = LocationPolicy.from_settings(settings)
        self.scratch = scratch or Path(tempfile.mkdtemp(prefix="sluice-batch-"))

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
