"""Triton's restricted APIs (``--http-restricted-api``, ``--grpc-restricted-protocol``):
groups of endpoints that answer only requests carrying a header with an agreed value.

A setting holds one or more groups, separated by ``;`` (each of Triton's repeated flags is
one): ``<category>[,<category>...]:<header>=<value>``. The categories are Triton's. Over
gRPC the header is ``triton-grpc-protocol-<header>``, as in Triton (HTTP/2 names are lower
case). This is Triton's mechanism, beside Sluice's own API keys: both apply.
"""

from __future__ import annotations

import hmac
import re
from collections.abc import Iterable, Mapping
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

_HEADER = re.compile(r"[0-9a-z_.-]+")
"""A header name both HTTP and gRPC metadata can carry (gRPC's keys, in lower case)."""
_VALUE = re.compile(r"([\x21-\x7e]([\x20-\x7e]*[\x21-\x7e])?)?")
"""A value both can carry as it is: visible ASCII with inner spaces (HTTP strips spaces at
the ends, and gRPC's text values are printable ASCII); a setting's value outside these
could never be matched, locking its categories for good."""


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
        if not _HEADER.fullmatch(restriction.header):
            raise ValueError(
                f"the header name {restriction.header!r} is not one a request can carry "
                "(letters, digits and -_.)"
            )
        if not _VALUE.fullmatch(value):
            raise ValueError(
                f"the value of the header {restriction.header!r} is not one a request can "
                "carry: printable ASCII, without spaces at either end (HTTP drops those)"
            )
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
    headers: Mapping[str, str] | Iterable[tuple[str, str]],
    prefix: str = "",
) -> str | None:
    """Why a request of ``category`` with ``headers`` (names in lower case; pairs where a
    name may come more than once) is refused, in Triton's words for HTTP (``prefix`` "")
    or gRPC (:data:`GRPC_PREFIX`); None: it is not.

    The header must come with the agreed value, compared in constant time; where it comes
    more than once, every value must be the agreed one, so that whichever one a proxy in
    front reads (the first, the last, all of them joined) the answer is the same."""
    if category is None:
        return None
    restriction = restrictions.get(category)
    if restriction is None:
        return None
    name = prefix + restriction.header
    pairs = headers.items() if isinstance(headers, Mapping) else headers
    expected = restriction.value.encode()
    given = [value for key, value in pairs if key == name]
    if given and all(hmac.compare_digest(value.encode(), expected) for value in given):
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
    if len(parts) == 5 and parts[3] in ("versions", "labels"):
        # A version's metadata, or the metadata of the version a label names (Sluice's,
        # the same document: in the category of its Triton counterpart, as a label's
        # inference and readiness are).
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
