"""What the health, metadata, repository and statistics endpoints answer, whatever the wire:
the REST routes (:mod:`sluice.gateway.http.routes`) and the gRPC service
(:mod:`sluice.gateway.grpc_api`) render the same documents, in Triton's JSON form (which is
also its protobuf's)."""

from __future__ import annotations

from typing import Any

from sluice.core.catalog import UNLOADED
from sluice.core.errors import InvalidInput, NotFound, Unavailable
from sluice.core.fields import json_type
from sluice.core.observability.statistics import render_model_stats
from sluice.core.on_demand import LOADING
from sluice.core.on_demand import UNLOADED as ON_DEMAND_UNLOADED
from sluice.gateway.control.catalog_view import NoReadyVersion, UnknownNamespacedModel
from sluice.gateway.control.metadata import model_metadata
from sluice.gateway.state import GatewayState


def server_not_ready(state: GatewayState) -> str | None:
    """Why the server is not ready (None: it is)."""
    if not state.redis_ok:
        return "server is not ready: Redis is unreachable"
    if not state.view.loaded:
        return "server is not ready: the model catalog is not loaded yet"
    if state.settings.strict_readiness:
        waiting = state.view.not_ready()
        if waiting:
            return f"server is not ready: {_listed(waiting)}"
    return None


def _listed(models: list[str], most: int = 5) -> str:
    shown = ", ".join(models[:most])
    more = f" and {len(models) - most} more" if len(models) > most else ""
    return f"model(s) not ready: {shown}{more}"


def model_not_ready(state: GatewayState, model: str, version: str | None) -> str | None:
    """Why a model version cannot serve (None: it is ready), after Triton's
    "Model version not ready"; a name several repositories hold is not ready (model
    namespacing: Triton answers so, not with its error). An unknown model is the NotFound it
    is without namespacing: Triton's readiness drops the lookup's error, whose code alone
    namespacing changes."""
    found = state.view.models.get(model)
    if found is not None and found.ambiguous:
        return f"Model version not ready; {found.error}"
    if found is not None:
        try:
            state.view.refuse_unloaded(model, found)
        except NotFound as exc:  # (a model not loaded is not ready, as without namespacing)
            return f"Model version not ready; {exc.message}"
    try:
        entry, number = state.view.resolve(model, version)
    except UnknownNamespacedModel as exc:
        raise NotFound(exc.message) from None
    except (Unavailable, NoReadyVersion) as exc:
        return f"Model version not ready; {exc.message}"
    if not state.view.is_ready(model, number) and not entry.on_demand:
        return f"Model version not ready; model '{model}' version {number} has no live worker yet"
    return None


def metadata_document(state: GatewayState, model: str, version: str | None) -> dict[str, Any]:
    """Triton's model metadata: refused as an inference request naming the model (and
    version) would be; without a version, every version served but those whose load
    failed."""
    view = state.view
    entry, number = view.resolve(model, version)
    if version is None:
        return model_metadata(
            entry, [v for v in entry.versions if view.load_error(model, v) is None]
        )
    return model_metadata(entry, [number])


def config_document(state: GatewayState, model: str, version: str | None) -> dict[str, Any]:
    entry, _ = state.view.resolve(model, version)
    assert entry.config is not None
    return dict(entry.config.raw)


def repository_rows(state: GatewayState, ready_only: Any) -> list[dict[str, str]]:
    """The repository index: one row per model version (per model when unavailable; by its
    name alone for a model of the repository never loaded, as Triton lists it). With
    model namespacing, each copy of a name several repositories hold is listed under that
    name (in the repositories' order), as Triton lists them, and the name itself is not."""
    if not isinstance(ready_only, bool):
        raise InvalidInput(
            f"Invalid value for 'ready': expected a boolean; got {json_type(ready_only)}"
        )
    view = state.view
    rows: list[dict[str, str]] = []
    listed = sorted(
        (view.listed_as(name), name) for name, e in view.models.items() if not e.ambiguous
    )
    for shown, name in listed:
        entry = view.models[name]
        if entry.error == UNLOADED and not entry.once_loaded:
            if not ready_only:  # (Triton: a model it never loaded is listed by name alone)
                rows.append({"name": shown})
            continue
        if not entry.available:
            if not ready_only:
                rows.append({"name": shown, "state": "UNAVAILABLE", "reason": entry.error or ""})
            continue
        for version in entry.versions:
            error = view.load_error(name, version)
            if view.is_ready(name, version):
                row = {"name": shown, "version": str(version), "state": "READY", "reason": ""}
            elif entry.on_demand and error is None:
                loading = view.on_demand.get((name, version)) == LOADING
                row = {
                    "name": shown,
                    "version": str(version),
                    "state": LOADING if loading else ON_DEMAND_UNLOADED,
                    "reason": "",
                }
            elif error is not None:
                row = {
                    "name": shown,
                    "version": str(version),
                    "state": "UNAVAILABLE",
                    "reason": error,
                }
            else:
                row = {"name": shown, "version": str(version), "state": "LOADING", "reason": ""}
            if not ready_only or row["state"] in ("READY", ON_DEMAND_UNLOADED):
                rows.append(row)
    return rows


def stats_targets(state: GatewayState, model: str, version: str | None) -> list[tuple[str, int]]:
    """The model versions a statistics request covers (``model`` empty: every one)."""
    if not model:
        return sorted(
            (entry.name, number)
            for entry in state.view.models.values()
            if entry.available
            for number in entry.versions
        )
    if version is None:
        entry = state.view.entry(model)
        state.view.refuse_unloaded(model, entry)
        return [(model, number) for number in entry.versions]
    _, number = state.view.resolve(model, version)
    return [(model, number)]


async def stats_document(state: GatewayState, models: list[tuple[str, int]]) -> dict[str, Any]:
    hashes = await state.control.model_statistics(models)
    stats = [
        render_model_stats(state.view.listed_as(name), version, *found)
        for (name, version), found in zip(models, hashes, strict=True)
    ]
    return {"model_stats": stats}
