"""JSON in and out of the routes other than inference: the object a management route takes
as its body (or a 400 saying what is wrong), and a JSON response."""

from __future__ import annotations

from typing import Any

import orjson
from starlette.responses import Response

from sluice.core.errors import InvalidInput


def json_object(body: bytes, *, empty_ok: bool = False) -> dict[str, Any]:
    """``body`` as a JSON object; ``{}`` for an empty body when ``empty_ok``."""
    if empty_ok and not body.strip():
        return {}
    try:
        document = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise InvalidInput(f"malformed request body: {exc}") from None
    if not isinstance(document, dict):
        raise InvalidInput("request body must be a JSON object")
    return document


def json_response(body: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(body), status_code=status, media_type="application/json")
