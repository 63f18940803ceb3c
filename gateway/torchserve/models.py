"""The models and versions TorchServe's API names, with TorchServe's 404s for those that
are not registered (shared by the management routes, the inference routes and the API
descriptions).

With model namespacing (:mod:`sluice.core.repository_namespaces`), a name several
repositories hold is one model to TorchServe's API: listed once while any copy is
registered, and refused with Triton's words (400) wherever a request names it, as it names
no one copy (a registration too, whether a copy is registered or not); a copy's internal
name is unknown to clients (TorchServe's 404)."""

from __future__ import annotations

from sluice.core.catalog import UNLOADED, CatalogEntry
from sluice.core.errors import InvalidInput, NotFound
from sluice.core.torchserve.versions import find, record_of
from sluice.gateway.control.catalog_view import CatalogView
from sluice.gateway.state import GatewayState
from sluice.gateway.torchserve.exception_types import ModelVersionNotFound


def listed(view: CatalogView) -> dict[str, str]:
    """The registered models, each by the name clients know it by -> the catalog's model
    that stands for it. With model namespacing, a name several repositories hold is listed
    once (for its first copy, in the repository index's order) while any copy is
    registered, as the repository index lists a row for each copy under the name; a
    copy's internal name is never listed."""
    names: dict[str, str] = {}
    for name, entry in sorted(view.models.items()):
        if entry.error != UNLOADED and not entry.ambiguous:
            names.setdefault(entry.listed_as or name, name)
    return names


def ambiguity(entry: CatalogEntry) -> InvalidInput:
    """The 400, in Triton's words, for a request naming a name several repositories hold
    (TorchServe's answer to a request it cannot carry out as asked)."""
    return InvalidInput(entry.error or f"model '{entry.name}' is ambiguous")


def registrable(state: GatewayState, model: str) -> CatalogEntry | None:
    """The catalog entry a registration of ``model`` adds a version to, if any. A name
    several repositories hold is refused (:func:`ambiguity`) whether a copy of it is
    registered or not: each repository's copy would take the archive as a version of its
    own, laid over what that repository holds."""
    entry = state.view.models.get(model)
    if entry is not None and entry.ambiguous:
        raise ambiguity(entry)
    return entry


def registered(state: GatewayState, model: str) -> CatalogEntry:
    """The catalog entry of ``model``; TorchServe's 404 when it is not registered, a copy's
    internal name included (model namespacing: clients cannot name one). A name several
    repositories hold names no one model while a copy of it is registered: a 400 with
    Triton's words (:func:`ambiguity`)."""
    entry = state.view.models.get(model)
    if entry is not None and entry.ambiguous and model in listed(state.view):
        raise ambiguity(entry)
    if entry is None or entry.error == UNLOADED or entry.listed_as or entry.ambiguous:
        raise NotFound(f"Model not found: {model}")
    return entry


def served_versions(entry: CatalogEntry) -> dict[int, str]:
    """Number -> TorchServe's version, of each version served."""
    parameters = entry.config.parameters if entry.config is not None else {}
    return {number: record_of(parameters, number).version for number in entry.versions}


def version_number(entry: CatalogEntry, text: str) -> int:
    """The number of the version TorchServe calls ``text`` (exactly: ``2`` is not ``2.0``);
    TorchServe's 404 when the model has no such version, a name that is no number (``abc``)
    included."""
    number = find(text, served_versions(entry))
    if number is None:
        raise ModelVersionNotFound(f"Model version: {text} does not exist for model: {entry.name}")
    return number
