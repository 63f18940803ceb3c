"""The OpenAPI description of the inference routes.

``POST /v2/models/{model}[/versions/{version} | /labels/{label}]/infer`` is served by the
plain ASGI handler in :mod:`sluice.gateway.http.fast_path`, ahead of the FastAPI routes, so FastAPI
does not know these routes; they are added to its schema here, described and not handled,
so that the schema lists every route the gateway answers."""

from __future__ import annotations

from typing import Any

INFER_PATHS = (
    "/v2/models/{model}/infer",
    "/v2/models/{model}/versions/{version}/infer",
    "/v2/models/{model}/labels/{label}/infer",
)

_SUMMARY = {
    "/v2/models/{model}/infer": "Infer",
    "/v2/models/{model}/versions/{version}/infer": "Infer with a model version",
    "/v2/models/{model}/labels/{label}/infer": "Infer with a labelled model version",
}

_BODY = {
    "description": (
        "A KServe v2 inference request: JSON, or a JSON header followed by binary tensors "
        "(its length in the Inference-Header-Content-Length header). "
        "'Prefer: respond-async' submits it as a job (202 and its URL in Location)."
    ),
    "required": True,
    "content": {
        "application/json": {"schema": {"type": "object"}},
        "application/octet-stream": {"schema": {"type": "string", "format": "binary"}},
    },
}

_RESPONSES = {
    "200": {
        "description": "The inference response (JSON, or JSON and binary tensors)",
        "content": {
            "application/json": {"schema": {"type": "object"}},
            "application/octet-stream": {"schema": {"type": "string", "format": "binary"}},
        },
    },
    "202": {"description": "Accepted as a job (Prefer: respond-async)"},
    "400": {"description": "The request does not fit the model"},
}


def _operation(path: str) -> dict[str, Any]:
    names = [part[1:-1] for part in path.split("/") if part.startswith("{")]
    return {
        "summary": _SUMMARY[path],
        "operationId": "infer_" + "_".join(names),
        "parameters": [
            {"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
            for name in names
        ],
        "requestBody": _BODY,
        "responses": _RESPONSES,
    }


def describe_inference(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` with the inference routes added (in place; adding them twice is harmless)."""
    paths = schema.setdefault("paths", {})
    for path in INFER_PATHS:
        paths.setdefault(path, {})["post"] = _operation(path)
    return schema
