"""Management of version labels and traffic splits (see :mod:`sluice.core.routing`):

- ``GET /v2/repository/models/{m}/routing``: the model's labels and weights.
- ``PUT /v2/repository/models/{m}/routing``: ``{"labels": {...}, "weights": {...}}``; each
  part given replaces that part, a part left out stays as it is.
- ``DELETE /v2/repository/models/{m}/routing``: no labels, no split.
- ``PUT /v2/repository/models/{m}/routing/labels/{label}`` ``{"version": N}`` and
  ``DELETE`` of the same path: one label.

While a rollout of the model is under way its split (and shadow) are the controller's: a
change of weights, or a DELETE, is a 409; labels may change.

Changes are read, checked against the catalog (versions must be served) and written in one
optimistic Redis transaction, so two administrators cannot interleave; this gateway applies
the result at once, the others at their next refresh. The paths start with
``/v2/repository``, so the edge guard treats them as management endpoints.
"""

from __future__ import annotations

from collections.abc import Callable

import orjson
from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response

from sluice.core.errors import Conflict, InvalidInput
from sluice.core.rollout import FINISHED
from sluice.core.routing import (
    MAX_LABELS,
    Routing,
    check_label,
    parse_labels,
    parse_version,
    parse_weights,
)
from sluice.gateway.http.json_body import json_object
from sluice.gateway.state import GatewayState, state_of

routing_router = APIRouter()

_PATH = "/v2/repository/models/{model}/routing"
_PARTS = ("labels", "weights")


def _answer(model: str, routing: Routing) -> Response:
    return Response(orjson.dumps(routing.to_json(model)), media_type="application/json")


@routing_router.get(_PATH)
async def get_routing(request: Request, model: str) -> Response:
    state = state_of(request)
    state.view.entry(model)  # 404 for an unknown model
    return _answer(model, await state.control.routing(model))


@routing_router.put(_PATH)
async def put_routing(request: Request, model: str) -> Response:
    state = state_of(request)
    served = state.view.entry(model).versions
    document = json_object(await request.body())
    unknown = [key for key in document if key not in _PARTS]
    if unknown or not document:
        shown = f"unknown field {repr(unknown[0])[:40]}; " if unknown else ""
        raise InvalidInput(f"{shown}the body names 'labels', 'weights' or both")
    labels = parse_labels(document["labels"], served, model) if "labels" in document else None
    weights = parse_weights(document["weights"], served, model) if "weights" in document else None
    if weights is not None:
        await _no_rollout_under_way(state, model)

    def change(current: Routing) -> Routing:
        return Routing(
            current.labels if labels is None else labels,
            current.weights if weights is None else weights,
            current.shadow,  # (a rollout's, as the controller set it)
        )

    return _answer(model, await update_routing(state, model, change))


@routing_router.delete(_PATH)
async def delete_routing(request: Request, model: str) -> Response:
    state = state_of(request)
    state.view.entry(model)
    await _no_rollout_under_way(state, model)
    return _answer(model, await update_routing(state, model, lambda _: Routing()))


@routing_router.put(_PATH + "/labels/{label}")
async def put_label(request: Request, model: str, label: str) -> Response:
    state = state_of(request)
    served = state.view.entry(model).versions
    check_label(label)
    document = json_object(await request.body())
    if set(document) != {"version"}:
        raise InvalidInput('the body must be {"version": <version>}')
    version = parse_version(document["version"], "'version'", served, model)

    def change(current: Routing) -> Routing:
        labels = {**current.labels, label: version}
        if len(labels) > MAX_LABELS:
            raise InvalidInput(f"model '{model}' has {MAX_LABELS} labels already, the most")
        return Routing(labels, current.weights, current.shadow)

    return _answer(model, await update_routing(state, model, change))


@routing_router.delete(_PATH + "/labels/{label}")
async def delete_label(request: Request, model: str, label: str) -> Response:
    state = state_of(request)
    state.view.entry(model)
    check_label(label)

    def change(current: Routing) -> Routing:
        labels = {name: v for name, v in current.labels.items() if name != label}
        return Routing(labels, current.weights, current.shadow)

    return _answer(model, await update_routing(state, model, change))


async def _no_rollout_under_way(state: GatewayState, model: str) -> None:
    """409 while a rollout of ``model`` is under way: its split is the rollout's (a split
    removed while the candidate loads would send it every request before it is judged)."""
    raw = await state.control.rollout(model)
    try:
        phase = orjson.loads(raw).get("phase") if raw is not None else None
    except (orjson.JSONDecodeError, AttributeError):
        phase = None
    if isinstance(phase, str) and phase not in FINISHED:
        raise Conflict(
            f"model '{model}' has a rollout under way ({phase}), which sets its traffic split; "
            "promote it or roll it back first (labels may change)"
        )


async def update_routing(
    state: GatewayState, model: str, change: Callable[[Routing], Routing]
) -> Routing:
    """Change the model's routing in the control plane; this gateway applies it at once,
    the other gateway processes of its host before their next request."""
    routing = await state.control.update_routing(model, change)
    state.view.routing.apply(model, routing)
    state.host_changes.bump()
    return routing
