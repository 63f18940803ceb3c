"""Triton's restricted APIs (``--http-restricted-api``, ``--grpc-restricted-protocol``):
groups of endpoints that answer only requests carrying a header with an agreed value.

A setting holds one or more groups, separated by ``;`` (each of Triton's repeated flags is
one): ``<category>[,<category>...]:<header>=<value>``. The categories are Triton's. Over
gRPC the header is ``triton-grpc-protocol-<header>``, as in Triton (HTTP/2 names are lower
case). This is Triton's mechanism, beside Sluice's own API keys: both apply.
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping
from dataclasses import dataclass

CATEGORIES = (
    "health",
    "metadata",
    "inference",
    "shared-memory",
    "model-config",
    "model-repository",
    "statistics",
    "trace",
    "logging",
)
GRPC_PREFIX = "triton-grpc-protocol-"


@dataclass(frozen=True, slots=True)
class Restriction:
    header: str
    """Lower case (header names are compared without case)."""
    value: str


def parse_restrictions(text: str) -> dict[str, Restriction]:
    """Category -> its restriction; ValueError naming what is wrong."""
    found: dict[str, Restriction] = {}
    for group in (g.strip() for g in text.split(";")):
        if not group:
            continue
        categories, colon, pair = group.rpartition(":")
        header, equals, value = pair.partition("=")
        if not colon or not equals or not categories.strip() or not header.strip():
            raise ValueError(
                "each group is <category>[,<category>...]:<header>=<value> (groups joined by ';')"
            )
        restriction = Restriction(header.strip().lower(), value)
        for category in (c.strip() for c in categories.split(",")):
            if category not in CATEGORIES:
                raise ValueError(
                    f"unknown API category {category!r}; known: {', '.join(CATEGORIES)}"
                )
            if category in found:
                raise ValueError(f"the category {category!r} is in more than one group")
            found[category] = restriction
    return found


def denial(
    restrictions: Mapping[str, Restriction],
    category: str | None,
    headers: Mapping[str, str],
    prefix: str = "",
) -> str | None:
    """Why a request of ``category`` with ``headers`` (names in lower case) is refused,
    in Triton's words for HTTP (``prefix`` "") or gRPC (:data:`GRPC_PREFIX`); None: it is
    not."""
    if category is None:
        return None
    restriction = restrictions.get(category)
    if restriction is None:
        return None
    name = prefix + restriction.header
    given = headers.get(name)
    if given is not None and hmac.compare_digest(given.encode(), restriction.value.encode()):
        return None
    what = "protocol" if prefix else "API"
    return f"This {what} is restricted, expecting header '{name}'"


_GRPC_CATEGORIES = {
    "ServerLive": "health",
    "ServerReady": "health",
    "ModelReady": "health",
    "ServerMetadata": "metadata",
    "ModelMetadata": "metadata",
    "ModelInfer": "inference",
    "ModelStreamInfer": "inference",
    "ModelConfig": "model-config",
    "ModelStatistics": "statistics",
    "RepositoryIndex": "model-repository",
    "RepositoryModelLoad": "model-repository",
    "RepositoryModelUnload": "model-repository",
    "SystemSharedMemoryStatus": "shared-memory",
    "SystemSharedMemoryRegister": "shared-memory",
    "SystemSharedMemoryUnregister": "shared-memory",
    "CudaSharedMemoryStatus": "shared-memory",
    "CudaSharedMemoryRegister": "shared-memory",
    "CudaSharedMemoryUnregister": "shared-memory",
    "TraceSetting": "trace",
    "LogSettings": "logging",
}


def grpc_category(method: str) -> str | None:
    """The category of one of Triton's gRPC methods (None: Sluice's own)."""
    return _GRPC_CATEGORIES.get(method)


def http_category(path: str) -> str | None:
    """The category of an HTTP path as Triton's endpoints group them (None: outside them:
    Sluice's own routes, metrics, TorchServe's)."""
    if path in ("/v2", "/v2/"):
        return "metadata"
    if path.startswith("/v2/health/"):
        return "health"
    if path.startswith(("/v2/systemsharedmemory", "/v2/cudasharedmemory")):
        return "shared-memory"
    if path.startswith("/v2/repository"):
        return "model-repository"
    if path.startswith("/v2/logging"):
        return "logging"
    if path.startswith("/v2/trace"):
        return "trace"
    if not path.startswith("/v2/models/"):
        return None
    parts = path.strip("/").split("/")
    if len(parts) == 3:  # /v2/models/{m}: its metadata; /v2/models/stats: every model's
        return "statistics" if parts[2] == "stats" else "metadata"
    if len(parts) == 5 and parts[3] == "versions":
        return "metadata"
    tail = parts[-1]
    if tail == "ready":
        return "health"
    if tail in ("infer", "generate", "generate_stream"):
        return "inference"
    if tail == "config":
        return "model-config"
    if tail == "stats":
        return "statistics"
    if tail == "setting" and parts[-2] == "trace":
        return "trace"
    return None
