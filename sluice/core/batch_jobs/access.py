"""Which server paths and ``s3://`` locations a tenant's batch jobs may name.

By default none: a tenant uploads its data (``POST /v2/uploads``) and downloads its outputs
from the batch store through the gateway. The operator may allow more:

- ``SLUICE_BATCH_ALLOWED_LOCATIONS``: ``tenant=regex`` or ``*=regex`` rules, each regex
  matched against the whole location (and, for a local path, against its real path too, so
  a link cannot lead out of what a rule allows);
- ``SLUICE_BATCH_ROOT``: every local path under this directory, links resolved, for every
  tenant.

Whatever a rule says, no batch job reads or writes inside the model repository, the
repository cache, the batch store (outside the tenant's own area) or the Python environment
the server runs from. A refusal reads the same whether the location exists or not, and
names only what the client sent.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from sluice.core.batch_jobs.store import split_s3
from sluice.core.errors import Forbidden
from sluice.core.settings import BatchStoreSettings

ANY_TENANT = "*"


def parse_rules(value: str) -> tuple[tuple[str, re.Pattern[str]], ...]:
    """``tenant=regex`` rules (the settings class has checked their syntax)."""
    rules = []
    for rule in (r.strip() for r in value.split(",")):
        if rule:
            tenant, _, pattern = rule.partition("=")
            rules.append((tenant.strip(), re.compile(pattern.strip())))
    return tuple(rules)


def _real(path: str) -> Path:
    return Path(os.path.realpath(path))


def _inside(path: Path, area: Path) -> bool:
    return path == area or area in path.parents


def _s3_inside(location: str, area: str) -> bool:
    bucket, key = split_s3(location)
    area_bucket, prefix = split_s3(area)
    if bucket != area_bucket:
        return False
    prefix = prefix.strip("/")
    return not prefix or key.strip("/") == prefix or key.startswith(prefix + "/")


@dataclass(frozen=True)
class LocationPolicy:
    rules: tuple[tuple[str, re.Pattern[str]], ...]
    root: Path | None
    forbidden_paths: tuple[Path, ...]
    forbidden_s3: tuple[str, ...]
    store: str
    """The batch store, local (a real path) or ``s3://``; empty: none."""

    @classmethod
    def from_settings(cls, settings: BatchStoreSettings) -> LocationPolicy:
        paths = [_real(settings.repository_cache_dir), _real(sys.prefix), _real(sys.base_prefix)]
        s3: list[str] = []
        for repository in settings.model_repository:
            if repository.startswith("s3://"):
                s3.append(repository)
            else:
                paths.append(_real(repository))
        store = settings.batch_store
        if store and not store.startswith("s3://"):
            store = str(_real(store))
        return cls(
            parse_rules(settings.batch_allowed_locations),
            _real(settings.batch_root) if settings.batch_root else None,
            tuple(p for p in paths if p != Path("/")),
            tuple(s3),
            store,
        )

    def check(self, tenant: str, location: str, field: str) -> str:
        """``location`` as it is to be opened (a local path: its real path); Forbidden
        (403) naming ``field`` when this tenant may not use it."""
        if location.startswith("s3://"):
            if self._allowed_s3(tenant, location):
                return location
        else:
            real = _real(location)
            if self._allowed_path(tenant, location, real):
                return str(real)
        raise Forbidden(
            f"'{field}': {location[:300]} is not a location this deployment lets you use "
            "(upload the data with POST /v2/uploads and leave out 'output', or ask the "
            "operator to allow it with SLUICE_BATCH_ALLOWED_LOCATIONS)"
        )

    def _matches(self, tenant: str, *texts: str) -> bool:
        return any(
            rule_tenant in (tenant, ANY_TENANT) and all(pattern.fullmatch(t) for t in texts)
            for rule_tenant, pattern in self.rules
        )

    def _allowed_s3(self, tenant: str, location: str) -> bool:
        if any(_s3_inside(location, area) for area in self.forbidden_s3):
            return False
        if self.store.startswith("s3://") and _s3_inside(location, self.store):
            own = self.store.rstrip("/") + f"/{tenant}"
            if not _s3_inside(location, own):
                return False
        return self._matches(tenant, location)

    def _allowed_path(self, tenant: str, location: str, real: Path) -> bool:
        if any(_inside(real, area) for area in self.forbidden_paths):
            return False
        if self.store and not self.store.startswith("s3://"):
            store = Path(self.store)
            if _inside(real, store) and not _inside(real, store / tenant):
                return False
        if self.root is not None and _inside(real, self.root):
            return True
        return self._matches(tenant, location, str(real))
