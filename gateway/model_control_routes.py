"""``POST /v2/repository/models/{model}/load`` and ``/unload`` (model repository extension).

Sluice serves what its repository holds, like Triton in its default
``--model-control-mode=none``, which refuses both calls. Until the controller takes
explicit load / unload, these routes answer as Triton does then (core
``ModelRepositoryManager::LoadUnloadModel``: UNAVAILABLE, so 503, whatever the model and
the body), with a hint after Triton's text. Triton's ``/v2/repository/{repository}/...``
form answers 501, as Triton does for any repository name. The paths start with
``/v2/repository``, so the edge guard treats them as management endpoints.
"""

from __future__ import annotations

from fastapi import APIRouter
from starlette.responses import Response

from sluice.errors import Unavailable, Unsupported

model_control_router = APIRouter()

NOT_ALLOWED = "explicit model load / unload is not allowed if polling is enabled"
"""Triton's answer to load / unload when model control is not explicit (modes NONE, POLL)."""

_HINT = (
    "Sluice serves every model of its repository as it starts (Triton's "
    "--model-control-mode=none); change the repository and restart `sluice up` to load or "
    "unload a model"
)


@model_control_router.post("/v2/repository/models/{model}/load")
@model_control_router.post("/v2/repository/models/{model}/unload")
async def load_or_unload(model: str) -> Response:
    raise Unavailable(f"{NOT_ALLOWED}; {_HINT}")


@model_control_router.post("/v2/repository/{repository}/models/{model}/load")
@model_control_router.post("/v2/repository/{repository}/models/{model}/unload")
async def load_or_unload_in(repository: str, model: str) -> Response:
    raise Unsupported("'repository_name' specification is not supported")
