"""TorchServe's API description: ``OPTIONS /`` and ``GET /api-description`` on each of its
ports, and one model's API at ``OPTIONS /predictions/{model}[/{version}]`` (inference) and
``OPTIONS /models/{model}[/{version}]`` (management).

TorchServe answers them with an OpenAPI document of what the port serves (``openapi``;
``info`` with ``title``, ``description`` and ``version``; ``paths``), which clients feed to
code generators. Here each document is cut from the gateway's own OpenAPI schema (FastAPI's
route table, with the inference routes of :mod:`sluice.gateway.http.schema`): a port's
document has the routes its filter lets through (:mod:`sluice.gateway.torchserve.ports`),
and a model's the routes of that port that name the model, with its name in their paths.
So a document lists what the port answers, as the gateway answers it, and a route added
to the gateway appears in the document of every port that serves it. The query parameters
that TorchServe's routes read themselves are given beside each route
(:mod:`sluice.gateway.torchserve.route_docs`).

Components the kept operations refer to (FastAPI's validation errors) come along, so the
document stands alone.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator, Mapping
from typing import Any
from urllib.parse import quote

import orjson
from fastapi import Request
from starlette.types import Scope, Send

from sluice import __version__
from sluice.gateway.control.catalog_follow import follow_changes
from sluice.gateway.state import state_of
from sluice.gateway.torchserve.models import registered, version_number

DESCRIPTION_PATH = "/api-description"
TITLE = "TorchServe APIs"
_ABOUT = "TorchServe's API, as Sluice serves it"
_MODEL = "{model}"
_SCHEMAS = "#/components/schemas/"

METHOD_NOT_ALLOWED = json.dumps(
    {
        "code": 405,
        "type": "MethodNotAllowedException",
        "message": "Requested method is not allowed, please refer to API document.",
    }
).encode()

_OPENAPI_ANSWER = {
    "200": {
        "description": "The OpenAPI description",
        "content": {
            "application/json": {
                "schema": {
                    "type": "object",
                    "required": ["openapi", "info", "paths"],
                    "properties": {
                        "openapi": {"type": "string"},
                        "info": {"type": "object"},
                        "paths": {"type": "object"},
                    },
                }
            }
        },
    }
}
DESCRIPTION_PATHS: dict[str, dict[str, Any]] = {
    "/": {
        "options": {
            "summary": "The API description of this port",
            "operationId": "apiDescription",
            "responses": _OPENAPI_ANSWER,
        }
    },
    DESCRIPTION_PATH: {
        "get": {
            "summary": "The API description of this port (as OPTIONS /)",
            "operationId": "api_description",
            "responses": _OPENAPI_ANSWER,
        }
    },
}
"""The description's own routes, answered by each TorchServe port ahead of the gateway."""


def port_document(
    schema: Mapping[str, Any],
    served: Callable[[str], bool],
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The description of a port that serves the paths of ``schema`` that ``served``
    accepts, and the description's own routes; ``extra``: paths the port answers outside
    the route table."""
    paths = {"/": DESCRIPTION_PATHS["/"]}
    paths.update({p: item for p, item in schema.get("paths", {}).items() if served(p)})
    paths.update(extra or {})
    paths[DESCRIPTION_PATH] = DESCRIPTION_PATHS[DESCRIPTION_PATH]
    return _document(schema, TITLE, paths)


def model_document(
    schema: Mapping[str, Any], served: Callable[[str], bool], model: str, title: str
) -> dict[str, Any]:
    """The description of ``model``'s API: the paths of ``schema`` that ``served`` accepts
    and that name a model (a segment of its own, or before a verb: KServe v1's
    ``{model}:explain``), with ``model`` in place of that name."""
    name = quote(model, safe="")
    paths: dict[str, Any] = {}
    for template, item in schema.get("paths", {}).items():
        segments = template.split("/")
        if not any(_names_model(s) for s in segments) or not served(template):
            continue
        path = "/".join(
            name + segment.removeprefix(_MODEL) if _names_model(segment) else segment
            for segment in segments
        )
        paths[path] = {method: _without_model(operation) for method, operation in item.items()}
    return _document(schema, title + model, paths)


def _names_model(segment: str) -> bool:
    return segment == _MODEL or segment.startswith(_MODEL + ":")


async def model_api(
    request: Request, served: Callable[[str], bool], model: str, version: str | None, title: str
) -> bytes:
    """:func:`model_document` of the application's schema for a registered ``model`` (and
    ``version``, when one is named), as JSON: NotFound with TorchServe's texts otherwise.
    Made on a thread: the first call builds the whole schema."""
    state = state_of(request)
    await follow_changes(state)
    entry = registered(state, model)
    if version is not None:
        version_number(entry, version)
    schema = request.app.openapi
    return await asyncio.to_thread(lambda: _encode(model_document(schema(), served, model, title)))


class PortDescription:
    """A TorchServe port's answers to ``OPTIONS /`` (and ``405`` to any other method on
    ``/``, as TorchServe) and to ``/api-description`` (any method, as TorchServe); the
    document is made once, on a thread, when first asked for."""

    def __init__(self, document: Callable[[], dict[str, Any]]) -> None:
        self._document = document
        self._encoded: bytes | None = None

    async def answer(self, scope: Scope, send: Send) -> bool:
        """Answer ``scope`` when it asks for the description; whether it did."""
        path = scope["path"]
        if path == "/" and scope["method"] != "OPTIONS":
            await _send(send, 405, METHOD_NOT_ALLOWED, [(b"allow", b"OPTIONS")])
            return True
        if path not in ("/", DESCRIPTION_PATH):
            return False
        if self._encoded is None:
            self._encoded = await asyncio.to_thread(lambda: _encode(self._document()))
        await _send(send, 200, self._encoded)
        return True


def _document(schema: Mapping[str, Any], title: str, paths: dict[str, Any]) -> dict[str, Any]:
    document: dict[str, Any] = {
        "openapi": schema.get("openapi", "3.1.0"),
        "info": {"title": title, "description": _ABOUT, "version": __version__},
        "paths": paths,
    }
    available = schema.get("components", {}).get("schemas", {})
    wanted = _referred(paths, available)
    if wanted:
        document["components"] = {"schemas": {name: available[name] for name in sorted(wanted)}}
    return document


def _referred(paths: Any, available: Mapping[str, Any]) -> set[str]:
    """The component schemas ``paths`` refer to, and those they refer to in turn."""
    found: set[str] = set()
    pending = list(_refs(paths))
    while pending:
        name = pending.pop()
        if name not in found and name in available:
            found.add(name)
            pending.extend(_refs(available[name]))
    return found


def _refs(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str) and value.startswith(_SCHEMAS):
                yield value.removeprefix(_SCHEMAS)
            else:
                yield from _refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from _refs(value)


def _without_model(operation: Any) -> Any:
    """``operation`` without its model path parameter (the path names the model)."""
    if not isinstance(operation, dict) or "parameters" not in operation:
        return operation
    kept = [
        p
        for p in operation["parameters"]
        if not (p.get("in") == "path" and p.get("name") == "model")
    ]
    trimmed = {key: value for key, value in operation.items() if key != "parameters"}
    return {**trimmed, "parameters": kept} if kept else trimmed


def _encode(document: dict[str, Any]) -> bytes:
    return orjson.dumps(document, option=orjson.OPT_INDENT_2)


async def _send(
    send: Send, status: int, body: bytes, extra: list[tuple[bytes, bytes]] | None = None
) -> None:
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send(
        {"type": "http.response.start", "status": status, "headers": headers + (extra or [])}
    )
    await send({"type": "http.response.body", "body": body})
