"""``POST /v2/repository/models/{model}/load`` and ``/unload`` (model repository extension).

In Triton's default ``--model-control-mode=none`` Sluice serves what its repository holds
and these routes answer as Triton does then (core ``ModelRepositoryManager::LoadUnloadModel``:
UNAVAILABLE, so 503, whatever the model and the body), with a hint after Triton's text.
With ``sluice up --model-control-mode explicit`` the gateway hands the command to
``sluice up`` through Redis (:mod:`sluice.core.control`) and answers once it is carried out:
200 with an empty body, or 400 with the reason (Triton's "failed to load '<m>', ...").
Triton's ``/v2/repository/{repository}/...`` form answers 501, as Triton does for any
repository name. The paths start with ``/v2/repository``, so the edge guard treats them as
management endpoints.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response

from sluice.core.control import ControlCommand
from sluice.core.errors import InvalidInput, Unsupported
from sluice.gateway.control.model_control import NAMED_REPOSITORY, carry_out, require_explicit
from sluice.gateway.http.json_body import json_object
from sluice.gateway.state import GatewayState, state_of

model_control_router = APIRouter()

_FILE_PREFIX = "file:"


_INT_MAX = (1 << 31) - 1
"""The longest base64 value Triton decodes (its decoder counts in ``int``)."""


@model_control_router.post("/v2/repository/models/{model}/load")
async def load(model: str, request: Request) -> Response:
    state = await _explicit(request)
    parameters = _parameters(await request.body())
    config = parameters.get("config")
    if config is not None and not isinstance(config, str):
        raise InvalidInput("'config' must be the model configuration as a JSON string")
    files = {
        name[len(_FILE_PREFIX) :]: file_content(name, value)
        for name, value in parameters.items()
        if name.startswith(_FILE_PREFIX)
    }
    await carry_out(state, ControlCommand("load", model, config, files))
    return Response(status_code=200)


@model_control_router.post("/v2/repository/models/{model}/unload")
async def unload(model: str, request: Request) -> Response:
    state = await _explicit(request)
    unload_dependents = _parameters(await request.body()).get("unload_dependents", False)
    if not isinstance(unload_dependents, bool):
        raise InvalidInput("'unload_dependents' must be a boolean")
    await carry_out(state, ControlCommand("unload", model, dependents=unload_dependents))
    return Response(status_code=200)


def file_content(name: str, value: Any, max_encoded: int = _INT_MAX) -> bytes:
    """The bytes of a ``file:<path>`` load parameter (base64). Triton refuses an encoded
    value longer than INT_MAX with the text below; a body that large is refused before
    (``SLUICE_MAX_CONTROL_BODY_BYTES``) unless that limit was raised past 2 GiB."""
    if not isinstance(value, str):
        raise InvalidInput(f"'{name}' must be base64-encoded file content")
    if len(value) > max_encoded:
        raise InvalidInput(
            f"'{name}' exceeds the maximum allowed data size limit INT_MAX; its base64 text "
            f"is {len(value)} characters long"
        )
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidInput(f"'{name}' is not valid base64") from None


async def _explicit(request: Request) -> GatewayState:
    state = state_of(request)
    await require_explicit(state)
    return state


def _parameters(body: bytes) -> dict[str, Any]:
    parameters = json_object(body, empty_ok=True).get("parameters", {})
    if not isinstance(parameters, dict):
        raise InvalidInput("'parameters' must be a JSON object")
    return parameters


@model_control_router.post("/v2/repository/{repository}/models/{model}/load")
@model_control_router.post("/v2/repository/{repository}/models/{model}/unload")
async def load_or_unload_in(repository: str, model: str) -> Response:
    raise Unsupported(NAMED_REPOSITORY)
