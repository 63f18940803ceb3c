"""Routes addressing a model version by label, as TensorFlow Serving's
``/models/{m}/labels/{label}``: metadata and readiness (inference by label is served by
:mod:`sluice.gateway.http.fast_path`). Inference endpoints for the edge guard."""

from __future__ import annotations

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response

from sluice.core.errors import Unavailable
from sluice.gateway.control.metadata import model_metadata
from sluice.gateway.http.json_body import json_response
from sluice.gateway.state import state_of

label_router = APIRouter()


@label_router.get("/v2/models/{model}/labels/{label}")
async def label_metadata(request: Request, model: str, label: str) -> Response:
    entry, number = state_of(request).view.resolve(model, None, label)
    return json_response(model_metadata(entry, [number]))


@label_router.get("/v2/models/{model}/labels/{label}/ready")
async def label_ready(request: Request, model: str, label: str) -> Response:
    """As ``/v2/models/{m}/versions/{v}/ready`` for the version the label names."""
    view = state_of(request).view
    try:
        _, number = view.resolve(model, None, label)
    except Unavailable as exc:
        return json_response({"error": f"Model version not ready; {exc.message}"}, 400)
    if not view.is_ready(model, number):
        detail = f"model '{model}' version {number} has no live worker yet"
        return json_response({"error": f"Model version not ready; {detail}"}, 400)
    return Response(status_code=200)  # (no body, as Triton's answer for a version)
