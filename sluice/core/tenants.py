"""Tenants: who an API key belongs to.

Every job, batch job, idempotency key, upload, output and listing belongs to a tenant, and
no tenant can see another's. A key entry is ``tenant:key`` (in ``SLUICE_API_KEYS``,
``SLUICE_ADMIN_KEYS`` or their files, one per line). A bare ``key`` (no colon) is a tenant
of its own, named after a hash of the key, so that deployments set up before tenants existed
keep each key's jobs apart. Without any key the deployment has one tenant, ``anonymous``.

Tenant names go into Redis keys and storage paths, so they are restricted to
:data:`TENANT_NAME`, less :data:`RESERVED_TENANT_NAMES`; an entry with another name is
refused at start.
"""

from __future__ import annotations

import hashlib
import re
from contextvars import ContextVar
from dataclasses import dataclass

ANONYMOUS = "anonymous"
"""The one tenant of a deployment without API keys."""

ADMIN = "admin"
"""The tenant of an admin key given without a tenant name."""

CURRENT_TENANT: ContextVar[str] = ContextVar("sluice_tenant", default=ANONYMOUS)
"""The tenant of the request being served in this task: set where its key is checked (the
HTTP guard, the gRPC key check), read where the request is queued, so the tenant travels
with the request without every route passing it along."""

TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")

RESERVED_TENANT_NAMES = frozenset({"running"})
"""Names a tenant cannot have: its batch listing, ``Keys.batches(tenant)``, would be the
deployment's set of running batches (``Keys.running_batches``)."""


def is_tenant_name(value: str) -> bool:
    return bool(TENANT_NAME.fullmatch(value)) and value not in RESERVED_TENANT_NAMES


@dataclass(frozen=True, slots=True)
class KeyEntry:
    tenant: str
    key: bytes


def parse_key_entry(entry: str, default_tenant: str | None = None) -> KeyEntry:
    """One ``tenant:key`` (or bare ``key``) entry; ValueError naming what is wrong (never
    the key itself)."""
    entry = entry.strip()
    tenant, colon, key = entry.partition(":")
    if not colon:
        key, tenant = entry, default_tenant or _hashed_tenant(entry)
    if not key:
        raise ValueError(f"the key of tenant '{tenant[:64]}' is empty")
    if not is_tenant_name(tenant):
        raise ValueError(
            f"'{tenant[:64]}' is not a tenant name (1 to 64 letters, digits, '_', '.', '-', "
            "starting with a letter or digit; not "
            + ", ".join(f"'{name}'" for name in sorted(RESERVED_TENANT_NAMES))
            + ")"
        )
    return KeyEntry(tenant, key.encode())


def _hashed_tenant(key: str) -> str:
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:16]
