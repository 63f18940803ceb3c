"""The model catalog: what the controller tells gateways about each model.

The controller reads the repository and writes one entry per model into the
catalog hash (see :mod:`sluice.core.keys`); gateways read it to answer metadata
requests and to validate inference requests without touching the repository.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack

from sluice.core.config import ModelConfig, config_from_json, config_to_json
from sluice.core.errors import InvalidConfig
from sluice.core.wire import SCHEMA_VERSION, MalformedEntry

UNLOADED = "unloaded"
"""The ``error`` of a model of the repository that is not loaded (explicit model control):
listed in the repository index as Triton does, not counted against readiness."""


@dataclass(frozen=True, slots=True)
class CatalogEntry:
    name: str
    versions: tuple[int, ...]
    """Versions the controller serves (ascending)."""
    config: ModelConfig | None
    error: str | None = None
    """Why the model is unavailable, when it is."""
    on_demand: bool = False
    """Loaded when a request comes, unloaded when others need the memory
    (:mod:`sluice.core.on_demand`): ready to take requests whether or not a worker runs."""
    listed_as: str = ""
    """Model namespacing (:mod:`sluice.core.repository_namespaces`): for a copy of a name
    several repositories hold, served under the internal name ``name``, the name the
    repository index lists it under; clients cannot name it. Empty otherwise."""
    ambiguous: bool = False
    """Model namespacing: a name several repositories hold, with no model of its own; a
    request naming it is refused with ``error`` (Triton's words)."""
    namespace: str = ""
    """Model namespacing: the repository the model comes from (its location as named), which
    Triton's texts and metric labels name it by; empty otherwise."""
    once_loaded: bool = False
    """Explicit model control: a model not loaded (``error`` :data:`UNLOADED`) that was
    loaded, or failed to load, since the executors started. Triton keeps the names it has
    tried in its map of namespaces: its repository index lists them with a state (one never
    tried by its name alone), and with model namespacing it answers a request naming one
    otherwise than one never loaded.
    """

    @property
    def available(self) -> bool:
        return self.config is not None and self.error is None and bool(self.versions)


def encode_entry(entry: CatalogEntry) -> bytes:
    body: dict[str, Any] = {
        "v": SCHEMA_VERSION,
        "name": entry.name,
        "versions": list(entry.versions),
        "config": None if entry.config is None else config_to_json(entry.config),
        "error": entry.error,
        "on_demand": entry.on_demand,
    }
    if entry.listed_as:  # (only with model namespacing: entries are as before otherwise)
        body["listed_as"] = entry.listed_as
    if entry.ambiguous:
        body["ambiguous"] = True
    if entry.namespace:
        body["namespace"] = entry.namespace
    if entry.once_loaded:
        body["once_loaded"] = True
    packed: bytes = msgpack.packb(body)
    return packed


def decode_entry(raw: bytes) -> CatalogEntry:
    try:
        body = msgpack.unpackb(raw, raw=False)
        if not isinstance(body, dict) or body.get("v") != SCHEMA_VERSION:
            raise MalformedEntry("catalog entry has no supported schema version")
        name = body["name"]
        config_json = body["config"]
        error = body.get("error")
        config = None
        if config_json is not None:
            try:
                config = config_from_json(config_json, model_name=name)
            except InvalidConfig as exc:
                config, error = None, exc.message
        return CatalogEntry(
            name=name,
            versions=tuple(int(v) for v in body["versions"]),
            config=config,
            error=error,
            on_demand=bool(body.get("on_demand", False)),
            listed_as=str(body.get("listed_as", "")),
            ambiguous=bool(body.get("ambiguous", False)),
            namespace=str(body.get("namespace", "")),
            once_loaded=bool(body.get("once_loaded", False)),
        )
    except (KeyError, TypeError, ValueError, msgpack.UnpackException) as exc:
        raise MalformedEntry(f"bad catalog entry: {exc}") from None
