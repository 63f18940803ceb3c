"""The models and versions TorchServe's API names, with TorchServe's 404s for those that
are not registered (shared by the management routes and the API descriptions)."""

from __future__ import annotations

from sluice.core.catalog import UNLOADED, CatalogEntry
from sluice.core.errors import NotFound
from sluice.core.torchserve.versions import decimal_of, find, record_of
from sluice.gateway.state import GatewayState
from sluice.gateway.torchserve.exception_types import ModelVersionNotFound


def registered(state: GatewayState, model: str) -> CatalogEntry:
    """The catalog entry of ``model``; TorchServe's 404 when it is not registered."""
    entry = state.view.models.get(model)
    if entry is None or entry.error == UNLOADED:
        raise NotFound(f"Model not found: {model}")
    return entry


def served_versions(entry: CatalogEntry) -> dict[int, str]:
    """Number -> TorchServe's version, of each version served."""
    parameters = entry.config.parameters if entry.config is not None else {}
    return {number: record_of(parameters, number).version for number in entry.versions}


def version_number(entry: CatalogEntry, text: str) -> int:
    """The number of the version TorchServe calls ``text`` (``1.0``, or Sluice's ``1``);
    TorchServe's 404 when the model has no such version, a name that is no number (``abc``)
    included: TorchServe's versions are names, and that one is not served."""
    number = find(text, served_versions(entry)) if decimal_of(text) is not None else None
    if number is None:
        raise ModelVersionNotFound(f"Model version: {text} does not exist for model: {entry.name}")
    return number
